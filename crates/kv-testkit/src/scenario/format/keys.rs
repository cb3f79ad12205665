//! The keys a scenario file may hold, read off the very serde types the reader deserializes
//! (and the step keys `read.rs` takes out by name), so that the list cannot drift from what
//! the reader accepts: tidy checks that `docs/scenario-format.md` documents each of them.
//!
//! serde's derived `Deserialize` names a struct's fields and an enum's variants, renames
//! applied and skipped fields left out, to the deserializer it is given. [`Probe`] is a
//! deserializer that only writes those names down and stops.

use std::fmt;

use kv_sched_adapter::{DecodeState, LoadFailurePolicy, Mode, ReleaseReason};
use serde::de::{self, DeserializeOwned, DeserializeSeed, IntoDeserializer, Visitor};
use serde::Deserialize;

use super::read::{ClusterFile, FileHead, PolicyFile, STEP_KEYS, WAIT_KEYS};
use super::{Event, Expect, ForgedMessage};

/// Every key a scenario file may hold, where, and the words its named choices take, exactly as
/// the reader accepts them.
///
/// ```
/// let keys = kv_testkit::scenario::Keys::accepted();
/// assert!(keys.cluster.contains(&"prefill_tp"));
/// let (_, arrive) = keys.events.iter().find(|(name, _)| *name == "arrive").unwrap();
/// assert!(arrive.contains(&"remote_request"));
/// ```
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Keys {
    /// The file's own keys: `name`, `cluster`, `policy` and `step`.
    pub file: Vec<&'static str>,
    /// The keys of `[cluster]`.
    pub cluster: Vec<&'static str>,
    /// The keys of `[policy]`.
    pub policy: Vec<&'static str>,
    /// The keys every `[[step]]` may hold beside its event's: `at_s`, `do` and `expect`.
    pub step: Vec<&'static str>,
    /// Every event a step's `do` may name, in declaration order, with the keys it takes
    /// (`wait`: the `node` whose expectations the step checks).
    pub events: Vec<(&'static str, Vec<&'static str>)>,
    /// The keys of a step's `expect`.
    pub expect: Vec<&'static str>,
    /// The words of each key that names one of a few choices (`mode`, `kv_load_failure_policy`,
    /// `forge`'s `message`), or whose table's values do (`p_released`, `d_state`).
    pub words: Vec<(&'static str, Vec<&'static str>)>,
}

impl Keys {
    /// The keys and words the reader accepts.
    pub fn accepted() -> Keys {
        let events = variants::<Event>().iter().map(|&name| (name, event_fields(name))).collect();
        Keys {
            file: fields::<FileHead>(),
            cluster: fields::<ClusterFile>(),
            policy: fields::<PolicyFile>(),
            step: STEP_KEYS.to_vec(),
            events,
            expect: fields::<Expect>(),
            words: vec![
                ("mode", variants::<Mode>()),
                ("kv_load_failure_policy", variants::<LoadFailurePolicy>()),
                ("message", variants::<ForgedMessage>()),
                ("p_released", variants::<ReleaseReason>()),
                ("d_state", variants::<DecodeState>()),
            ],
        }
    }
}

/// The fields a struct deserializes from.
fn fields<T: DeserializeOwned>() -> Vec<&'static str> {
    let mut seen = Seen::default();
    let _ = T::deserialize(Probe { seen: &mut seen, variant: None });
    seen.fields.expect("a struct names its fields").to_vec()
}

/// The variants an enum deserializes from.
fn variants<T: DeserializeOwned>() -> Vec<&'static str> {
    let mut seen = Seen::default();
    let _ = T::deserialize(Probe { seen: &mut seen, variant: None });
    seen.variants.expect("an enum names its variants").to_vec()
}

/// The keys of the event `name`: its variant's fields, or [`WAIT_KEYS`] for a unit variant.
fn event_fields(name: &'static str) -> Vec<&'static str> {
    let mut seen = Seen::default();
    let _ = Event::deserialize(Probe { seen: &mut seen, variant: Some(name) });
    match seen.fields {
        Some(fields) => fields.to_vec(),
        None => WAIT_KEYS.to_vec(),
    }
}

/// What a probe was told.
#[derive(Default)]
struct Seen {
    fields: Option<&'static [&'static str]>,
    variants: Option<&'static [&'static str]>,
}

/// A deserializer that writes down the names it is given and stops; an enum's `variant`, when
/// set, is entered to write down that variant's fields.
struct Probe<'a> {
    seen: &'a mut Seen,
    variant: Option<&'static str>,
}

/// How a probe stops.
#[derive(Debug)]
struct Stop;

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("probed")
    }
}

impl std::error::Error for Stop {}

impl de::Error for Stop {
    fn custom<T: fmt::Display>(_: T) -> Self {
        Stop
    }
}

impl<'de> de::Deserializer<'de> for Probe<'_> {
    type Error = Stop;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
        Err(Stop)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Stop> {
        self.seen.fields = Some(fields);
        Err(Stop)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Stop> {
        self.seen.variants = Some(variants);
        match self.variant {
            Some(name) => visitor.visit_enum(Variant { name, seen: self.seen }),
            None => Err(Stop),
        }
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option
        unit unit_struct newtype_struct seq tuple tuple_struct map identifier ignored_any
    }
}

/// One variant of an enum, entered by name.
struct Variant<'a> {
    name: &'static str,
    seen: &'a mut Seen,
}

impl<'de, 'a> de::EnumAccess<'de> for Variant<'a> {
    type Error = Stop;
    type Variant = Variant<'a>;

    fn variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<(S::Value, Self::Variant), Stop> {
        let value = seed.deserialize(IntoDeserializer::<Stop>::into_deserializer(self.name))?;
        Ok((value, self))
    }
}

impl<'de> de::VariantAccess<'de> for Variant<'_> {
    type Error = Stop;

    fn unit_variant(self) -> Result<(), Stop> {
        Ok(())
    }

    fn newtype_variant_seed<S: DeserializeSeed<'de>>(self, _: S) -> Result<S::Value, Stop> {
        Err(Stop)
    }

    fn tuple_variant<V: Visitor<'de>>(self, _: usize, _: V) -> Result<V::Value, Stop> {
        Err(Stop)
    }

    fn struct_variant<V: Visitor<'de>>(self, fields: &'static [&'static str], _: V) -> Result<V::Value, Stop> {
        self.seen.fields = Some(fields);
        Err(Stop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keys_are_the_reader_s() {
        let keys = Keys::accepted();
        assert_eq!(keys.file, ["name", "cluster", "policy", "step"]);
        assert_eq!(keys.step, ["at_s", "do", "expect"]);
        assert!(keys.cluster.len() >= 17, "{:?}", keys.cluster);
        assert!(keys.policy.contains(&"push_quarantine_s"));
        assert!(keys.expect.contains(&"rejections_unsent") && !keys.expect.contains(&"d_node"));
        let event = |name: &str| keys.events.iter().find(|(n, _)| *n == name).map(|(_, keys)| keys.clone());
        assert!(keys.events.len() >= 20, "{:?}", keys.events);
        assert_eq!(event("wait"), Some(vec!["node"]));
        assert_eq!(event("partition"), Some(vec!["a", "b", "until_s"]));
        assert_eq!(event("intrude"), Some(vec!["to", "as"]));
        assert_eq!(event("pause"), Some(vec!["node", "for_s"]));
        assert_eq!(keys.words[0], ("mode", vec!["pull", "push"]));
        assert!(keys.words.iter().any(|(key, words)| *key == "p_released" && words.contains(&"peer_lost")));
    }

    #[test]
    fn every_listed_key_reads_and_an_unlisted_one_is_refused() {
        // Each cluster and policy key, given alone, is known to the reader.
        let keys = Keys::accepted();
        for key in &keys.cluster {
            let value = match *key {
                "mode" => "\"push\"".to_owned(),
                "mla" => "true".to_owned(),
                "clock_skew_ms" => "{ decode0 = 1 }".to_owned(),
                _ => "2".to_owned(),
            };
            let text = format!("name = \"k\"\n[cluster]\n{key} = {value}\n");
            if let Err(e) = super::super::Scenario::from_toml_str(&text) {
                panic!("{key}: {e}");
            }
        }
        let text = "name = \"k\"\n[cluster]\nprefill_dp = 2\n";
        let e = super::super::Scenario::from_toml_str(text).unwrap_err().to_string();
        assert!(e.contains("unknown field `prefill_dp`"), "{e}");
    }
}
