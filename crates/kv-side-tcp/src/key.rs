//! Where an engine's cluster key comes from: a file or an environment variable that the
//! configuration names, never a command-line argument (which every user of the machine can
//! read in the process list).

use std::path::PathBuf;

use kv_core::side::ClusterKey;

/// Where a transport's cluster key is read from, when the transport is made.
///
/// Either form holds the key as 64 hex digits (surrounding whitespace ignored). Without a key
/// ([`KeySource::None`]) the side channel authenticates nobody, so the transport refuses to
/// listen anywhere but on loopback.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub enum KeySource {
    /// No key: loopback only.
    #[default]
    None,
    /// A file that holds the key; it should be readable by the engine's user alone.
    File(PathBuf),
    /// An environment variable, by name, that holds the key.
    Env(String),
}

impl KeySource {
    /// Reads the key; the error names where it looked, never what it found.
    pub fn load(&self) -> Result<ClusterKey, KeyError> {
        let (text, from) = match self {
            KeySource::None => return Ok(ClusterKey::none()),
            KeySource::File(path) => {
                let from = format!("key file {}", path.display());
                let text = std::fs::read_to_string(path)
                    .map_err(|e| KeyError { from: from.clone(), reason: e.to_string() })?;
                warn_if_shared(path);
                (text, from)
            }
            KeySource::Env(name) => {
                let from = format!("environment variable {name}");
                let text = std::env::var(name).map_err(|e| KeyError { from: from.clone(), reason: e.to_string() })?;
                (text, from)
            }
        };
        let mut text = text;
        let key = ClusterKey::from_hex(&text);
        // The key's text is as secret as the key: wiped before its buffer goes back.
        zeroize::Zeroize::zeroize(&mut text);
        let key = key.map_err(|e| KeyError { from: from.clone(), reason: e.to_string() })?;
        if key.is_none() {
            return Err(KeyError { from, reason: "the all-zero key authenticates nobody".into() });
        }
        Ok(key)
    }
}

/// Refuses to listen beyond loopback without a key: the side channel would then hand the
/// agent's KV pool (its metadata, a capability) to anyone who can reach it. The error is the
/// reason, naming the address; the adapter wraps it in its own configuration error.
pub fn check_bind(bind: std::net::SocketAddr, key: &ClusterKey) -> Result<(), String> {
    if !key.is_none() {
        return Ok(());
    }
    if !bind.ip().is_loopback() {
        return Err(format!(
            "the side channel would listen on {bind} without a cluster key, handing this agent's KV pool to \
             anyone who can reach it: set the transport's key, or bind to loopback"
        ));
    }
    tracing::info!(%bind, "no cluster key: the side channel listens on loopback only and authenticates nobody");
    Ok(())
}

/// Why the cluster key could not be read.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
#[error("cluster key from {from}: {reason}")]
pub struct KeyError {
    /// Where it was looked for (a file or an environment variable, by name).
    pub from: String,
    /// Why it is not a key; never the key itself.
    pub reason: String,
}

/// Logs when a key file can be read by other users of the machine.
fn warn_if_shared(path: &std::path::Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(meta) = std::fs::metadata(path) {
            let mode = meta.permissions().mode();
            if mode & 0o077 != 0 {
                let mode = format!("{:o}", mode & 0o777);
                tracing::warn!(path = %path.display(), mode, "the cluster key file is readable by other users");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

    #[test]
    fn keys_load_from_a_file_and_errors_name_the_place_not_the_key() {
        let dir = std::env::temp_dir().join(format!("kvflow-key-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good");
        std::fs::write(&good, format!("{HEX}\n")).unwrap();
        assert!(!KeySource::File(good).load().unwrap().is_none());

        let bad = dir.join("bad");
        std::fs::write(&bad, "0123456789abcdef").unwrap();
        let err = KeySource::File(bad.clone()).load().unwrap_err().to_string();
        assert!(err.contains(&bad.display().to_string()) && err.contains("16 hex characters"), "{err}");
        assert!(!err.contains("0123456789abcdef"), "{err}");

        let zero = dir.join("zero");
        std::fs::write(&zero, "0".repeat(64)).unwrap();
        assert!(KeySource::File(zero).load().unwrap_err().to_string().contains("all-zero"));

        let missing = KeySource::File(dir.join("missing")).load().unwrap_err().to_string();
        assert!(missing.contains("missing"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();

        assert!(KeySource::None.load().unwrap().is_none());
        let unset = KeySource::Env("KVFLOW_TEST_KEY_THAT_IS_NEVER_SET".into()).load().unwrap_err().to_string();
        assert!(unset.contains("KVFLOW_TEST_KEY_THAT_IS_NEVER_SET"), "{unset}");
    }
}
