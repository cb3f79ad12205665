//! [`EtcdConfig`]: where etcd is, under which prefix engines live, and their lease's TTL,
//! checked before anything connects.

use std::time::Duration;

/// How to reach etcd and what to keep there. [`EtcdConfig::validate`] runs in
/// [`EtcdDiscovery::connect`](crate::EtcdDiscovery::connect), so a value that cannot work fails
/// there, naming it.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct EtcdConfig {
    /// The etcd members' client URLs (`http://host:port`, or `host:port`, which means the
    /// same). This build has no TLS, so `https://` is refused.
    pub endpoints: Vec<String>,
    /// The key prefix of this deployment: engines live under `{prefix}/engines/`. It starts
    /// with `/` and does not end with one. Default `/kvflow`.
    pub prefix: String,
    /// The TTL of each engine's etcd lease: how long after its last keep-alive a silent engine
    /// stays published. etcd counts it in whole seconds and raises anything below its own
    /// minimum (about 2 s at etcd's default election settings) to that minimum. At least
    /// [`MIN_TTL`], whole seconds. Default 10 s.
    pub ttl: Duration,
}

/// The shortest lease TTL accepted: etcd counts leases in whole seconds.
pub const MIN_TTL: Duration = Duration::from_secs(1);

/// The longest lease TTL etcd grants (its `MaxLeaseTTL`, 9 000 000 000 s).
pub const MAX_TTL: Duration = Duration::from_secs(9_000_000_000);

impl Default for EtcdConfig {
    /// etcd's default client URL on loopback, prefix `/kvflow`, TTL 10 s.
    fn default() -> Self {
        EtcdConfig {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            prefix: "/kvflow".into(),
            ttl: Duration::from_secs(10),
        }
    }
}

/// A configuration value that cannot work.
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
pub enum ConfigError {
    /// The lease TTL is not whole seconds, or out of etcd's range.
    #[error("etcd lease ttl {ttl:?}: {why}")]
    Ttl {
        /// The TTL given.
        ttl: Duration,
        /// What is wrong with it.
        why: String,
    },
    /// No endpoint was given.
    #[error("no etcd endpoints given")]
    NoEndpoints,
    /// An endpoint cannot be a plain-HTTP etcd client URL.
    #[error("etcd endpoint {endpoint:?}: {why}")]
    Endpoint {
        /// The endpoint given.
        endpoint: String,
        /// What is wrong with it.
        why: String,
    },
    /// The key prefix is not of the form `/name[/name...]`.
    #[error("etcd key prefix {prefix:?}: {why}")]
    Prefix {
        /// The prefix given.
        prefix: String,
        /// What is wrong with it.
        why: String,
    },
}

impl EtcdConfig {
    /// Checks every field, naming the first value that cannot work.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let ttl = |why: String| Err(ConfigError::Ttl { ttl: self.ttl, why });
        if self.ttl < MIN_TTL {
            return ttl(format!("shorter than the minimum of {MIN_TTL:?}"));
        }
        if self.ttl.subsec_nanos() != 0 {
            return ttl("not a whole number of seconds, which is all etcd's leases count".into());
        }
        if self.ttl > MAX_TTL {
            return ttl(format!("longer than etcd's maximum of {} s", MAX_TTL.as_secs()));
        }
        if self.endpoints.is_empty() {
            return Err(ConfigError::NoEndpoints);
        }
        for endpoint in &self.endpoints {
            let bad = |why: &str| Err(ConfigError::Endpoint { endpoint: endpoint.clone(), why: why.into() });
            if endpoint.starts_with("https://") {
                return bad("TLS is not built into this adapter; use an http:// endpoint");
            }
            let authority = endpoint.strip_prefix("http://").unwrap_or(endpoint);
            if authority.is_empty() || authority.contains("://") {
                return bad("not a host:port or http://host:port URL");
            }
        }
        let prefix = |why: &str| Err(ConfigError::Prefix { prefix: self.prefix.clone(), why: why.into() });
        if !self.prefix.starts_with('/') || self.prefix.len() < 2 {
            return prefix("must start with '/' and name something after it");
        }
        if self.prefix.ends_with('/') {
            return prefix("must not end with '/' (engines live under {prefix}/engines/)");
        }
        Ok(())
    }

    /// The TTL in etcd's unit, whole seconds (after [`EtcdConfig::validate`]).
    pub(crate) fn ttl_secs(&self) -> i64 {
        i64::try_from(self.ttl.as_secs()).unwrap_or(i64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(change: impl FnOnce(&mut EtcdConfig), expected: Result<(), &str>) {
        let mut config = EtcdConfig::default();
        change(&mut config);
        assert_eq!(config.validate().map_err(|e| e.to_string()), expected.map_err(str::to_owned), "{config:?}");
    }

    #[test]
    fn each_field_is_checked_and_the_error_names_its_value() {
        check(|_| {}, Ok(()));
        check(|c| c.ttl = Duration::from_secs(2), Ok(()));
        check(|c| c.endpoints = vec!["127.0.0.1:2379".into(), "http://10.0.0.2:2379".into()], Ok(()));
        check(|c| c.prefix = "/a/b".into(), Ok(()));
        check(|c| c.ttl = Duration::ZERO, Err("etcd lease ttl 0ns: shorter than the minimum of 1s"));
        check(|c| c.ttl = Duration::from_millis(500), Err("etcd lease ttl 500ms: shorter than the minimum of 1s"));
        check(
            |c| c.ttl = Duration::from_millis(2500),
            Err("etcd lease ttl 2.5s: not a whole number of seconds, which is all etcd's leases count"),
        );
        check(
            |c| c.ttl = MAX_TTL + Duration::from_secs(1),
            Err("etcd lease ttl 9000000001s: longer than etcd's maximum of 9000000000 s"),
        );
        check(|c| c.endpoints.clear(), Err("no etcd endpoints given"));
        check(
            |c| c.endpoints = vec!["https://e:2379".into()],
            Err("etcd endpoint \"https://e:2379\": TLS is not built into this adapter; use an http:// endpoint"),
        );
        check(
            |c| c.endpoints = vec!["unix://x".into()],
            Err("etcd endpoint \"unix://x\": not a host:port or http://host:port URL"),
        );
        check(|c| c.endpoints = vec!["".into()], Err("etcd endpoint \"\": not a host:port or http://host:port URL"));
        check(
            |c| c.prefix = "kvflow".into(),
            Err("etcd key prefix \"kvflow\": must start with '/' and name something after it"),
        );
        check(|c| c.prefix = "/".into(), Err("etcd key prefix \"/\": must start with '/' and name something after it"));
        check(
            |c| c.prefix = "/kvflow/".into(),
            Err("etcd key prefix \"/kvflow/\": must not end with '/' (engines live under {prefix}/engines/)"),
        );
    }
}
