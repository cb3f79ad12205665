//! The key layout and the value encoding: `{prefix}/engines/{engine}` holds the engine's
//! [`EngineRecord`] as JSON, and anything else found there is refused with the reason.

use kv_core::discovery::EngineRecord;
use kv_core::EngineId;

use crate::MAX_VALUE_LEN;

/// The keys of one deployment, from its prefix.
#[derive(Clone, Debug)]
pub(crate) struct Keys {
    /// `{prefix}/engines/`: every engine's key starts with it.
    engines: String,
}

impl Keys {
    /// The keys under `prefix` (validated: starts with `/`, does not end with one).
    pub(crate) fn new(prefix: &str) -> Self {
        Keys { engines: format!("{prefix}/engines/") }
    }

    /// `{prefix}/engines/`.
    pub(crate) fn engines(&self) -> &str {
        &self.engines
    }

    /// The end of the range of keys that start with [`Keys::engines`] (etcd's prefix range:
    /// the prefix with its last byte incremented; it ends with `/`, so no carry).
    pub(crate) fn engines_end(&self) -> Vec<u8> {
        let mut end = self.engines.as_bytes().to_vec();
        if let Some(last) = end.last_mut() {
            *last += 1;
        }
        end
    }

    /// The key of `engine`'s record.
    pub(crate) fn engine(&self, engine: &EngineId) -> String {
        format!("{}{}", self.engines, engine.as_str())
    }

    /// The engine a key names, for messages about a key whose value cannot be read.
    pub(crate) fn engine_of<'k>(&self, key: &'k [u8]) -> std::borrow::Cow<'k, str> {
        String::from_utf8_lossy(key.strip_prefix(self.engines.as_bytes()).unwrap_or(key))
    }
}

/// The value stored for `record`.
pub(crate) fn encode(record: &EngineRecord) -> Vec<u8> {
    // Serializing a struct of strings, integers and vectors to JSON cannot fail.
    serde_json::to_vec(record).unwrap_or_default()
}

/// The record stored under `key`, or why the value is not one: larger than [`MAX_VALUE_LEN`],
/// not JSON of an [`EngineRecord`], a record that does not validate, or one that names another
/// engine than its key.
pub(crate) fn decode(keys: &Keys, key: &[u8], value: &[u8]) -> Result<EngineRecord, String> {
    if value.len() > MAX_VALUE_LEN {
        return Err(format!("value of {} bytes, over the limit of {MAX_VALUE_LEN}", value.len()));
    }
    let record: EngineRecord = serde_json::from_slice(value).map_err(|e| format!("not an engine record: {e}"))?;
    record.validate().map_err(|e| e.to_string())?;
    if keys.engine(&record.engine).as_bytes() != key {
        return Err(format!(
            "the record names engine {:?}, but sits under key {:?}",
            record.engine.as_str(),
            String::from_utf8_lossy(key)
        ));
    }
    Ok(record)
}

#[cfg(test)]
mod tests {
    use kv_core::{KvLayout, Role};

    use super::*;

    fn record(name: &str) -> EngineRecord {
        EngineRecord {
            engine: EngineId::new(name),
            instance: 7,
            role: Role::Prefill,
            addresses: vec!["127.0.0.1:5600".into()],
            layout: KvLayout::llama3_8b(16),
            tp_size: 1,
        }
    }

    #[test]
    fn keys_sit_under_the_engines_prefix_and_its_range_ends_right_after() {
        let keys = Keys::new("/kvflow");
        assert_eq!(keys.engine(&EngineId::new("p0")), "/kvflow/engines/p0");
        assert_eq!(keys.engines(), "/kvflow/engines/");
        assert_eq!(keys.engines_end(), b"/kvflow/engines0");
        assert_eq!(keys.engine_of(b"/kvflow/engines/p0"), "p0");
    }

    #[test]
    fn a_record_round_trips_and_anything_else_is_refused_with_the_reason() {
        let keys = Keys::new("/kvflow");
        let good = record("p0");
        assert_eq!(decode(&keys, b"/kvflow/engines/p0", &encode(&good)), Ok(good.clone()));

        let check = |key: &[u8], value: &[u8], why: &str| {
            let err = decode(&keys, key, value).unwrap_err();
            assert!(err.contains(why), "{err:?} should say {why:?}");
        };
        check(b"/kvflow/engines/p0", b"\xff garbage", "not an engine record");
        check(b"/kvflow/engines/p0", b"{}", "not an engine record");
        check(b"/kvflow/engines/p1", &encode(&good), "names engine \"p0\", but sits under key \"/kvflow/engines/p1\"");
        let mut wrong = good.clone();
        wrong.tp_size = 2;
        check(b"/kvflow/engines/p0", &encode(&wrong), "1 side-channel addresses for TP size 2");
        let huge = vec![b' '; MAX_VALUE_LEN + 1];
        check(b"/kvflow/engines/p0", &huge, "value of 65537 bytes, over the limit of 65536");
    }
}
