//! The handoff as a vLLM deployment sends it: the `kv_transfer_params` a request reaches D
//! with, in whichever form the router or proxy wrote it, decided here (feature `serde`).
//!
//! Three forms are taken:
//! - kvflow's own: P's answer passed on unchanged, whose `"kvflow"` key is the [`RemoteRef`]
//!   (and `"kvflow_layout"` P's block size);
//! - NixlConnector's pull form, which routers rebuild from P's answer without the `"kvflow"`
//!   key: P's engine (`remote_engine_id`), its side channel (`remote_host`, `remote_port`,
//!   where P's first rank listens and rank `r` at the port plus `r`), its request
//!   (`remote_request_id`), blocks (`remote_block_ids`) and TP size (`tp_size`);
//! - NixlPushConnector's push form (push mode): P's engine and side channel as above, and the
//!   `transfer_id` that pairs D's leg with P's (else `remote_request_id`), by which D's ranks
//!   name the export P may not have computed yet (P's engine pairs its request with the
//!   transfer id: `PrefillScheduler::handle_pairing`).
//!
//! kvflow's form carries its version (`kvflow_version`, [`HANDOFF_VERSION`]); a newer one is
//! refused by name. Whatever the form, the handoff comes through the client and is trusted
//! for nothing it does not prove: it says where to claim, and P's ranks lend their KV only to
//! a claim that names the prompt (and the blocks) P computed. The checks here refuse early,
//! with a reason, what cannot be this request's.
//!
//! What lets D read before P answered its claim (P's lease deadline, and the D engine the
//! router named at prefill, to which P bound the export) is taken only from a kvflow handoff
//! P vouched for under the cluster key (`kvflow_vouch`, [`ClusterKey::vouch`] over every field
//! of the [`RemoteRef`] and P's block size): a client that wrote its own handoff, naming
//! another request's export and blocks with its own prompt's digest, would otherwise have D
//! read another prompt's KV before P refused the claim. A handoff without a vouch that
//! verifies (changed after P made it, from an engine without a cluster key, whose tags prove
//! nothing, or from one with another key) is read as NixlConnector's form is: only once P has
//! answered the claim.
//!
//! P's answer ([`TransferParams::answer`]) carries kvflow's form and NixlConnector's fields
//! beside it, so that a router reading either works.

use kv_core::side::{ClusterKey, VOUCH_BYTES};
use kv_core::{blocks_for_tokens, BlockId, EngineId, PeerAddress, Prompt, RequestId, Time};
use serde::{Deserialize, Serialize};

use crate::common::{Consumer, ExportInfo, PrefillEngine, RemoteRef};
use crate::config::Mode;

/// The version of the handoff's forms as this module reads and writes them.
pub const HANDOFF_VERSION: u32 = 1;

/// The label of P's vouch for a handoff ([`ClusterKey::vouch`]).
pub const HANDOFF_VOUCH_LABEL: &[u8] = b"kvflow-handoff-v1";

/// The most TP ranks a handoff may name, and the most blocks: beyond them it is refused before
/// anything is sized from it.
pub const MAX_HANDOFF_TP: u64 = 1024;
/// See [`MAX_HANDOFF_TP`].
pub const MAX_HANDOFF_BLOCKS: usize = 1 << 20;

/// P's block size and TP size, as kvflow's form carries them beside the [`RemoteRef`].
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct LayoutNote {
    /// P's tokens per block.
    pub block_size: u32,
    /// P's TP size.
    pub tp_size: u32,
}

/// NixlConnector's block ids: one list, or (vLLM's hybrid KV cache manager) one per KV cache
/// group, of which kvflow takes a single group.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub enum BlockIds {
    /// One group's ids.
    Flat(Vec<u64>),
    /// One list per group.
    Groups(Vec<Vec<u64>>),
}

/// The `kv_transfer_params` fields kvflow reads or writes; others are ignored. Every field may
/// be absent or `null`.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct TransferParams {
    /// D: the prompt was computed remotely.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub do_remote_prefill: Option<bool>,
    /// P: export the prompt's KV.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub do_remote_decode: Option<bool>,
    /// kvflow's own handoff.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvflow: Option<RemoteRef>,
    /// P's block and TP size beside kvflow's handoff.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvflow_layout: Option<LayoutNote>,
    /// The version of kvflow's form ([`HANDOFF_VERSION`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvflow_version: Option<u32>,
    /// P's vouch for kvflow's handoff and its block size, in hex: [`ClusterKey::vouch`] under
    /// [`HANDOFF_VOUCH_LABEL`] over [`vouched_bytes`]; absent where P holds no cluster key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvflow_vouch: Option<String>,
    /// NixlConnector: P's engine id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_engine_id: Option<String>,
    /// NixlConnector: P's side-channel host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_host: Option<String>,
    /// NixlConnector: P's side-channel port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_port: Option<u64>,
    /// NixlConnector: P's request id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_request_id: Option<String>,
    /// NixlConnector: P's blocks, in prompt order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_block_ids: Option<BlockIds>,
    /// NixlConnector: P's TP size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u64>,
    /// NixlPushConnector: P's pipeline-parallel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_size: Option<u64>,
    /// NixlPushConnector: the id pairing D's leg with P's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_id: Option<String>,
}

/// Why D cannot use a handoff: the label of `kvflow_handoffs_refused_total`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum HandoffRefusal {
    /// It does not parse, or a field has a value no engine could have sent.
    Malformed,
    /// A field the form needs is missing.
    Incomplete,
    /// It was made for another prompt: another length, or other tokens.
    OtherPrompt,
    /// Its export has another number of blocks than the prompt fills.
    BlockCount,
    /// P's blocks hold another number of tokens than D's.
    BlockSize,
    /// A form this engine does not take (a push form in pull mode, a pull form in push mode,
    /// block ids of several KV cache groups).
    UnsupportedForm,
    /// vLLM's serving layer refused the request before admission.
    Refused,
}

impl HandoffRefusal {
    /// Every reason, in label order.
    pub const ALL: [HandoffRefusal; 7] = [
        HandoffRefusal::Malformed,
        HandoffRefusal::Incomplete,
        HandoffRefusal::OtherPrompt,
        HandoffRefusal::BlockCount,
        HandoffRefusal::BlockSize,
        HandoffRefusal::UnsupportedForm,
        HandoffRefusal::Refused,
    ];

    /// The metric's label.
    pub fn as_str(self) -> &'static str {
        match self {
            HandoffRefusal::Malformed => "malformed",
            HandoffRefusal::Incomplete => "incomplete",
            HandoffRefusal::OtherPrompt => "other_prompt",
            HandoffRefusal::BlockCount => "block_count",
            HandoffRefusal::BlockSize => "block_size",
            HandoffRefusal::UnsupportedForm => "unsupported_form",
            HandoffRefusal::Refused => "refused",
        }
    }
}

/// A handoff D refused: why, in words that name the values, and P's export where the handoff
/// names one (D rejects it, so P frees it at once).
#[derive(Clone, PartialEq, Eq, Debug, thiserror::Error)]
#[error("{reason}: {detail}", reason = reason.as_str())]
pub struct HandoffError {
    /// The metric's reason.
    pub reason: HandoffRefusal,
    /// What was wrong, with the values.
    pub detail: String,
    /// The export the handoff names, to reject.
    pub remote: Option<Box<RemoteRef>>,
}

/// What D knows of the request a handoff came with.
#[derive(Clone, Copy, Debug)]
pub struct Arrival {
    /// D's mode.
    pub mode: Mode,
    /// D's own prompt.
    pub prompt: Prompt,
    /// D's tokens per block.
    pub block_size: u32,
}

impl TransferParams {
    /// P's answer for an export: kvflow's handoff, P's layout, and NixlConnector's fields
    /// (where P's first rank listens, its request, blocks and TP size); with a cluster `key`
    /// (not the null key), P's vouch for the handoff.
    pub fn answer(remote: &RemoteRef, block_size: u32, key: &ClusterKey) -> TransferParams {
        let (host, port) = remote.prefill.addresses.first().map(split_address).unwrap_or_default();
        let vouch =
            (!key.is_none()).then(|| hex::encode(key.vouch(HANDOFF_VOUCH_LABEL, &vouched_bytes(remote, block_size))));
        TransferParams {
            do_remote_prefill: Some(true),
            do_remote_decode: Some(false),
            kvflow_layout: Some(LayoutNote { block_size, tp_size: remote.prefill.tp_size }),
            kvflow_version: Some(HANDOFF_VERSION),
            remote_engine_id: Some(remote.prefill.engine.to_string()),
            remote_host: Some(host),
            remote_port: Some(port),
            remote_request_id: Some(remote.request.to_string()),
            remote_block_ids: remote
                .export
                .as_ref()
                .map(|e| BlockIds::Flat(e.blocks.iter().map(|b| u64::from(b.0)).collect())),
            tp_size: Some(u64::from(remote.prefill.tp_size)),
            pp_size: Some(u64::from(remote.prefill.pp_size)),
            kvflow: Some(remote.clone()),
            kvflow_vouch: vouch,
            transfer_id: None,
        }
    }

    /// The export this request loads, if its parameters ask for a remote prefill: from
    /// kvflow's form or NixlConnector's pull form, checked against D's own request; P's
    /// deadline and named consumer kept only where P's vouch verifies under `key`.
    pub fn resolve(self, arrival: &Arrival, key: &ClusterKey) -> Result<Option<RemoteRef>, HandoffError> {
        match self.named(arrival, key)? {
            Some((remote, p_block_size)) => check(remote, p_block_size, arrival).map(Some),
            None => Ok(None),
        }
    }

    /// The refusal of a request vLLM's serving layer turned away before admission (submitted
    /// aborted, with a placeholder prompt, only so that P's blocks are freed): the export its
    /// parameters name, whatever its prompt, to reject; `None` if they name none.
    pub fn refused_before_admission(
        self,
        arrival: &Arrival,
        key: &ClusterKey,
    ) -> Result<Option<HandoffError>, HandoffError> {
        let detail = "vLLM's serving layer refused the request before admission".to_owned();
        Ok(self.named(arrival, key)?.map(|(remote, _)| refuse(HandoffRefusal::Refused, detail, Some(remote))))
    }

    /// The export the parameters name and P's block size, if they ask for a remote prefill.
    fn named(self, arrival: &Arrival, key: &ClusterKey) -> Result<Option<(RemoteRef, u32)>, HandoffError> {
        if self.do_remote_prefill != Some(true) {
            return Ok(None);
        }
        let (remote, p_block_size) = if let Some(remote) = self.kvflow.clone() {
            if let Some(version) = self.kvflow_version.filter(|v| *v > HANDOFF_VERSION) {
                let detail = format!("kvflow's handoff of version {version}; this engine reads {HANDOFF_VERSION}");
                return Err(refuse(HandoffRefusal::UnsupportedForm, detail, Some(remote)));
            }
            let block_size = self.kvflow_layout.map_or(arrival.block_size, |l| l.block_size);
            (self.vouched(remote, block_size, key), block_size)
        } else if self.remote_block_ids.is_some() {
            (self.nixl_pull(arrival)?, arrival.block_size)
        } else if self.transfer_id.is_some() || self.remote_engine_id.is_some() {
            if arrival.mode == Mode::Pull {
                let detail = "NixlPushConnector's push form (P's coordinates, no blocks) sent to a pull engine".into();
                return Err(refuse(HandoffRefusal::UnsupportedForm, detail, None));
            }
            (self.nixl_push(arrival)?, arrival.block_size)
        } else {
            return Err(refuse(
                HandoffRefusal::Incomplete,
                "do_remote_prefill without a handoff: neither kvflow's (\"kvflow\") nor NixlConnector's \
                 (\"remote_block_ids\", \"remote_engine_id\", ...)"
                    .into(),
                None,
            ));
        };
        Ok(Some((remote, p_block_size)))
    }

    /// kvflow's handoff `remote` as far as P vouched for it: whole where `kvflow_vouch`
    /// verifies under `key`; else (no vouch, a vouch that does not verify, or no key to check
    /// one with) without P's deadline and named consumer, so that D reads only once P has
    /// answered its claim, which names D's own prompt and the blocks it reads.
    fn vouched(&self, mut remote: RemoteRef, block_size: u32, key: &ClusterKey) -> RemoteRef {
        let verified = !key.is_none()
            && self.kvflow_vouch.as_deref().and_then(|text| hex::decode(text).ok()).is_some_and(|tag| {
                tag.len() == VOUCH_BYTES && key.vouched(HANDOFF_VOUCH_LABEL, &vouched_bytes(&remote, block_size), &tag)
            });
        if !verified {
            if let Some(export) = remote.export.as_mut() {
                export.deadline = Time::ZERO;
            }
            remote.consumer = None;
        }
        remote
    }

    /// NixlConnector's pull form as kvflow's handoff: P's ranks at the port and those after it.
    fn nixl_pull(&self, arrival: &Arrival) -> Result<RemoteRef, HandoffError> {
        let prefill =
            self.coordinates("NixlConnector's pull form", &[("remote_request_id", self.remote_request_id.is_none())])?;
        if prefill.pp_size != 1 {
            let detail = format!("pp_size {}: NixlConnector's pull form names one stage", prefill.pp_size);
            return Err(refuse(HandoffRefusal::Malformed, detail, None));
        }
        let request = checked_id("remote_request_id", self.remote_request_id.as_deref().expect("checked"))?;
        let blocks = self.blocks()?;
        Ok(RemoteRef {
            prefill,
            request,
            // NixlConnector's form says nothing of P's incarnation, lease or prompt: P's answer to
            // the claim, which names D's own prompt and these blocks, decides.
            instance: None,
            prompt_tokens: arrival.prompt.tokens,
            prompt_digest: None,
            export: Some(ExportInfo { blocks, deadline: Time::ZERO, finished: None }),
            consumer: None,
        })
    }

    /// NixlPushConnector's push form as kvflow's handoff: D registers its blocks with P's ranks
    /// (at the port and those after it) for the export its `transfer_id` (else
    /// `remote_request_id`) names, which P may not have computed yet.
    fn nixl_push(&self, arrival: &Arrival) -> Result<RemoteRef, HandoffError> {
        let pairing = self.transfer_id.is_none() && self.remote_request_id.is_none();
        let prefill = self.coordinates("NixlPushConnector's push form", &[("transfer_id", pairing)])?;
        let (name, id) = match (&self.transfer_id, &self.remote_request_id) {
            (Some(transfer), _) => ("transfer_id", transfer),
            (None, Some(request)) => ("remote_request_id", request),
            (None, None) => unreachable!("checked"),
        };
        Ok(RemoteRef {
            prefill,
            request: checked_id(name, id)?,
            instance: None,
            prompt_tokens: arrival.prompt.tokens,
            prompt_digest: None,
            export: None,
            consumer: None,
        })
    }

    /// P's engine as NixlConnector's forms name it: its id, and its ranks' side channels, all
    /// at `remote_port` (one port per engine, shared by its `tp_size` times `pp_size` ranks,
    /// each dialed as `host:port/tpRANK`); `form` and the other fields it needs (`more`: name,
    /// absent) name what is missing.
    fn coordinates(&self, form: &str, more: &[(&'static str, bool)]) -> Result<PrefillEngine, HandoffError> {
        let missing: Vec<&str> = [
            ("remote_engine_id", self.remote_engine_id.is_none()),
            ("remote_host", self.remote_host.is_none()),
            ("remote_port", self.remote_port.is_none()),
        ]
        .iter()
        .chain(more)
        .filter_map(|&(name, absent)| absent.then_some(name))
        .collect();
        if !missing.is_empty() {
            return Err(refuse(HandoffRefusal::Incomplete, format!("{form} without {}", missing.join(", ")), None));
        }
        let malformed = |detail: String| refuse(HandoffRefusal::Malformed, detail, None);
        let (tp, pp) = (self.tp_size.unwrap_or(1), self.pp_size.unwrap_or(1));
        if !(1..=MAX_HANDOFF_TP).contains(&tp) || !(1..=MAX_HANDOFF_TP).contains(&pp) || tp * pp > MAX_HANDOFF_TP {
            return Err(malformed(format!("tp_size {tp} x pp_size {pp} is not in 1..={MAX_HANDOFF_TP} ranks")));
        }
        let ranks = tp * pp;
        let port = self.remote_port.expect("checked");
        if port == 0 || port > u64::from(u16::MAX) {
            return Err(malformed(format!("remote_port {port} is not a port (1 to 65535)")));
        }
        let host = self.remote_host.as_deref().expect("checked");
        if host.is_empty() || host.len() > 253 || host.chars().any(|c| c.is_whitespace() || c == '/') {
            return Err(malformed(format!("remote_host {host:?} is no host name or address")));
        }
        let engine = self.remote_engine_id.as_deref().expect("checked");
        if engine.is_empty() || engine.len() > 256 {
            return Err(malformed(format!("remote_engine_id of {} bytes: it must be 1 to 256", engine.len())));
        }
        let host = if host.contains(':') { format!("[{host}]") } else { host.to_owned() };
        Ok(PrefillEngine {
            engine: EngineId::new(engine),
            addresses: (0..ranks as u32).map(|r| PeerAddress::of_rank(&format!("{host}:{port}"), r)).collect(),
            tp_size: tp as u32,
            pp_size: pp as u32,
        })
    }

    /// `remote_block_ids` as block ids: one list, or one group of hybrid lists.
    fn blocks(&self) -> Result<Vec<BlockId>, HandoffError> {
        let malformed = |detail: String| refuse(HandoffRefusal::Malformed, detail, None);
        let ids = match self.remote_block_ids.as_ref().expect("checked") {
            BlockIds::Flat(ids) => ids,
            BlockIds::Groups(groups) if groups.len() == 1 => &groups[0],
            BlockIds::Groups(groups) => {
                return Err(refuse(
                    HandoffRefusal::UnsupportedForm,
                    format!("remote_block_ids of {} KV cache groups: kvflow moves one group", groups.len()),
                    None,
                ))
            }
        };
        if ids.len() > MAX_HANDOFF_BLOCKS {
            return Err(malformed(format!("{} remote_block_ids, more than {MAX_HANDOFF_BLOCKS}", ids.len())));
        }
        ids.iter()
            .map(|&id| u32::try_from(id).map(BlockId).map_err(|_| malformed(format!("block id {id} is past u32"))))
            .collect()
    }
}

/// The bytes P vouches for: every field of `remote` and P's `block_size`, each length-prefixed
/// (big-endian `u64`s), absent options as a 0 byte and present ones as a 1 byte before them.
/// It names every field by destructuring, so a field added to the handoff fails to build here.
pub fn vouched_bytes(remote: &RemoteRef, block_size: u32) -> Vec<u8> {
    let RemoteRef { prefill, request, instance, prompt_tokens, prompt_digest, export, consumer } = remote;
    let PrefillEngine { engine, addresses, tp_size, pp_size } = prefill;
    let mut out = Vec::with_capacity(256);
    let text = |out: &mut Vec<u8>, text: &str| {
        out.extend_from_slice(&(text.len() as u64).to_be_bytes());
        out.extend_from_slice(text.as_bytes());
    };
    let number = |out: &mut Vec<u8>, n: u64| out.extend_from_slice(&n.to_be_bytes());
    let present = |out: &mut Vec<u8>, present: bool| out.push(u8::from(present));
    text(&mut out, engine.as_str());
    number(&mut out, addresses.len() as u64);
    for address in addresses {
        text(&mut out, &address.0);
    }
    number(&mut out, u64::from(*tp_size));
    number(&mut out, u64::from(*pp_size));
    text(&mut out, request.as_str());
    present(&mut out, instance.is_some());
    number(&mut out, instance.unwrap_or_default());
    number(&mut out, *prompt_tokens);
    present(&mut out, prompt_digest.is_some());
    out.extend_from_slice(&prompt_digest.map_or([0; 16], |d| d.0));
    present(&mut out, export.is_some());
    if let Some(ExportInfo { blocks, deadline, finished }) = export {
        number(&mut out, blocks.len() as u64);
        for block in blocks {
            number(&mut out, u64::from(block.0));
        }
        number(&mut out, deadline.as_nanos());
        present(&mut out, finished.is_some());
        number(&mut out, finished.map_or(0, Time::as_nanos));
    }
    present(&mut out, consumer.is_some());
    if let Some(Consumer { engine, instance }) = consumer {
        text(&mut out, engine.as_str());
        number(&mut out, *instance);
    }
    number(&mut out, u64::from(block_size));
    out
}

/// `host:port` split; an address without a port has port 0.
fn split_address(address: &PeerAddress) -> (String, u64) {
    match address.side_target().0.rsplit_once(':') {
        Some((host, port)) => {
            (host.trim_start_matches('[').trim_end_matches(']').to_owned(), port.parse().unwrap_or_default())
        }
        None => (address.0.clone(), 0),
    }
}

/// `id` (field `name`) as a request id: 1 to 256 bytes.
fn checked_id(name: &str, id: &str) -> Result<RequestId, HandoffError> {
    if id.is_empty() || id.len() > 256 {
        let detail = format!("{name} of {} bytes: it must be 1 to 256", id.len());
        return Err(refuse(HandoffRefusal::Malformed, detail, None));
    }
    Ok(RequestId::new(id))
}

fn refuse(reason: HandoffRefusal, detail: String, remote: Option<RemoteRef>) -> HandoffError {
    HandoffError { reason, detail, remote: remote.map(Box::new) }
}

/// Whether `remote` (P's blocks of `p_block_size` tokens) can be D's request's.
fn check(remote: RemoteRef, p_block_size: u32, arrival: &Arrival) -> Result<RemoteRef, HandoffError> {
    let ours = arrival.prompt;
    if remote.prompt_tokens != ours.tokens {
        let detail = format!("the request has {} prompt tokens, P computed {}", ours.tokens, remote.prompt_tokens);
        return Err(refuse(HandoffRefusal::OtherPrompt, detail, Some(remote)));
    }
    if let (Some(theirs), Some(mine)) = (remote.prompt_digest, ours.digest) {
        if theirs != mine {
            let detail =
                format!("the request's prompt tokens are not the ones P computed (digest {mine}, P's {theirs})");
            return Err(refuse(HandoffRefusal::OtherPrompt, detail, Some(remote)));
        }
    }
    if p_block_size != arrival.block_size {
        let detail = format!(
            "P's blocks hold {p_block_size} tokens, this engine's {}: they cannot exchange KV",
            arrival.block_size
        );
        return Err(refuse(HandoffRefusal::BlockSize, detail, Some(remote)));
    }
    if p_block_size == 0 {
        return Err(refuse(HandoffRefusal::Malformed, "a block size of 0".into(), Some(remote)));
    }
    match (arrival.mode, remote.export.as_ref()) {
        (Mode::Pull, None) => {
            let detail = "a pull handoff without P's export (a push form sent to a pull engine?)".to_owned();
            return Err(refuse(HandoffRefusal::UnsupportedForm, detail, Some(remote)));
        }
        (_, Some(export)) => {
            let needed = blocks_for_tokens(ours.tokens, p_block_size);
            if export.blocks.len() as u64 != needed {
                let detail = format!(
                    "the export has {} blocks, where {} tokens fill {needed} of {p_block_size}",
                    export.blocks.len(),
                    ours.tokens
                );
                return Err(refuse(HandoffRefusal::BlockCount, detail, Some(remote)));
            }
        }
        (Mode::Push, None) => {}
    }
    Ok(remote)
}

#[cfg(test)]
mod tests;
