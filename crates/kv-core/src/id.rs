//! Identifiers: requests, blocks, engines and the NIXL agents of their TP ranks.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The longest request id kvflow accepts, in bytes; longer ids are refused at decode.
pub const MAX_REQUEST_ID_LEN: usize = 256;

/// An engine's request id, as the router and the engine name it.
///
/// Parallel-sampling siblings are named `"{index}_{parent}"`; engines suffix the router's id
/// with `-` and 8 hex digits, which [`RequestId::base`] strips for push-mode matching.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RequestId(String);

impl RequestId {
    /// Wraps an engine's request id.
    pub fn new(id: impl Into<String>) -> Self {
        RequestId(id.into())
    }

    /// The id as the engine wrote it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The sibling's index and the parent id, when this id names a parallel-sampling sibling.
    ///
    /// A sibling id is decimal digits, `_`, and a non-empty parent: `0_req-77` is sibling 0 of
    /// `req-77`, while `chat_abc` and `x_1_abc` name no parent.
    pub fn sibling(&self) -> Option<(u32, RequestId)> {
        let (index, parent) = self.0.split_once('_')?;
        if index.is_empty() || parent.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let index = index.parse().ok()?;
        Some((index, RequestId(parent.to_owned())))
    }

    /// The parent of a parallel-sampling sibling, if this id names one.
    pub fn parent(&self) -> Option<RequestId> {
        self.sibling().map(|(_, parent)| parent)
    }

    /// The id with one trailing `-` plus exactly 8 hex digits removed, or the id itself.
    ///
    /// Both legs of a disaggregated request carry the router's id with an engine-specific
    /// suffix; push mode matches registrations to exports by this base when the exact id fails.
    pub fn base(&self) -> RequestId {
        let bytes = self.0.as_bytes();
        let n = bytes.len();
        if n >= 9 && bytes[n - 9] == b'-' && bytes[n - 8..].iter().all(u8::is_ascii_hexdigit) {
            RequestId(self.0[..n - 9].to_owned())
        } else {
            self.clone()
        }
    }
}

impl fmt::Debug for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for RequestId {
    fn from(id: &str) -> Self {
        RequestId::new(id)
    }
}

/// An index into one engine's KV pool.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub struct BlockId(pub u32);

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// An engine (one prefill or decode instance, all its TP ranks together).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct EngineId(String);

impl EngineId {
    /// Wraps an engine's id.
    pub fn new(id: impl Into<String>) -> Self {
        EngineId(id.into())
    }

    /// The id as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for EngineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for EngineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The NIXL agent of one TP rank of an engine: every rank has its own agent and pool.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct AgentName {
    /// The engine the rank belongs to.
    pub engine: EngineId,
    /// The rank within the engine's tensor-parallel group.
    pub rank: u32,
}

impl AgentName {
    /// The agent of `rank` of `engine`.
    pub fn new(engine: EngineId, rank: u32) -> Self {
        AgentName { engine, rank }
    }
}

impl fmt::Debug for AgentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for AgentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/tp{}", self.engine, self.rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_parent(id: &str, expected: Option<(u32, &str)>) {
        let got = RequestId::new(id).sibling();
        let got = got.as_ref().map(|(i, p)| (*i, p.as_str()));
        assert_eq!(got, expected, "sibling of {id:?}");
    }

    #[test]
    fn sibling_parsing() {
        check_parent("0_req-77", Some((0, "req-77")));
        check_parent("12_cmpl-abc", Some((12, "cmpl-abc")));
        check_parent("3_r1", Some((3, "r1")));
        check_parent("chat_abc", None);
        check_parent("x_1_abc", None);
        check_parent("cmpl-5f2e-1234abcd", None);
        check_parent("_abc", None);
        check_parent("7_", None);
        check_parent("r1", None);
        check_parent("+1_abc", None);
        // An index too large for u32 is not a sibling index.
        check_parent("99999999999_abc", None);
        assert_eq!(RequestId::new("0_req-77").parent(), Some(RequestId::new("req-77")));
        assert_eq!(RequestId::new("chat_abc").parent(), None);
    }

    fn check_base(id: &str, expected: &str) {
        assert_eq!(RequestId::new(id).base().as_str(), expected, "base of {id:?}");
    }

    #[test]
    fn base_parsing() {
        check_base("cmpl-5f2e-1234abcd", "cmpl-5f2e");
        check_base("cmpl-5f2e-1234ABCD", "cmpl-5f2e");
        check_base("0_req-77", "0_req-77");
        check_base("12_cmpl-abc", "12_cmpl-abc");
        check_base("chat_abc", "chat_abc");
        check_base("x_1_abc", "x_1_abc");
        // Seven or nine hex digits are not the engine suffix.
        check_base("req-1234abc", "req-1234abc");
        check_base("req-1234abcde", "req-1234abcde");
        check_base("req-1234abcg", "req-1234abcg");
        // Only one suffix is stripped.
        check_base("a-11111111-22222222", "a-11111111");
        check_base("-1234abcd", "");
        check_base("1234abcd", "1234abcd");
    }

    #[test]
    fn agent_names_read_as_engine_and_rank() {
        assert_eq!(AgentName::new(EngineId::new("prefill0"), 3).to_string(), "prefill0/tp3");
    }
}
