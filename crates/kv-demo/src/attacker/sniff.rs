//! The eavesdropper: as root, with a raw packet socket on the loopback interface, it records
//! the TCP transport's data connections to P while the demo runs (a restarted D's and the
//! storms' key holders' links, from their first byte), then replays what it recorded on
//! connections of its own: whole links verbatim (HELLO, PROOF, READs), and P's pool addresses
//! it saw in READ frames as targets of WRITE frames full of 0xEE. It holds no key; with the
//! data path bound to the side-channel session, P must serve none of it. A key holder then
//! tries the same under another D's name, with a PROOF of its own session.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Result;
use kv_core::side::FrameHeader;

use super::{Attacker, Outcome};

/// The most bytes kept of one recorded client-to-server stream: its HELLO, PROOF and first
/// requests are all the replay needs.
const FLOW_BYTES: usize = 256 * 1024;
/// The most streams kept.
const MAX_FLOWS: usize = 512;
/// `ETH_P_ALL`, every protocol, in network order as `socket` and `bind` want it.
const ETH_P_ALL: u16 = 0x0003;

/// One direction of a TCP connection, as recorded.
#[derive(Default)]
struct Flow {
    next_seq: Option<u32>,
    bytes: Vec<u8>,
    /// A segment went missing: what follows is not recorded.
    broken: bool,
    /// Its first recorded byte is the connection's first (the SYN was seen).
    from_start: bool,
}

/// What the sniffer recorded, by (source port, destination port).
#[derive(Default)]
struct Recording {
    flows: HashMap<(u16, u16), Flow>,
}

/// The sniffer's thread and what it recorded.
pub(super) struct Sniffer {
    stop: Arc<AtomicBool>,
    recording: Arc<Mutex<Recording>>,
    thread: Option<JoinHandle<()>>,
}

/// A raw packet socket bound to `lo`.
struct Capture(libc::c_int);

impl Drop for Capture {
    #[allow(unsafe_code)] // One libc call: see the SAFETY note.
    fn drop(&mut self) {
        // SAFETY: the descriptor is ours, opened by `open` and closed once, here.
        unsafe { libc::close(self.0) };
    }
}

impl Capture {
    /// A raw packet socket on `lo` that the kernel hands only TCP segments to or from `port`.
    #[allow(unsafe_code)] // The raw packet socket's system calls: see the SAFETY note.
    fn open(port: u16) -> io::Result<Capture> {
        // SAFETY: plain system calls on a descriptor this function owns; every pointer passed
        // points at a local of the size given.
        unsafe {
            let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(ETH_P_ALL.to_be()));
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            let capture = Capture(fd);
            let ifindex = libc::if_nametoindex(c"lo".as_ptr());
            if ifindex == 0 {
                return Err(io::Error::last_os_error());
            }
            let mut sll: libc::sockaddr_ll = std::mem::zeroed();
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = ETH_P_ALL.to_be();
            sll.sll_ifindex = ifindex as i32;
            let len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
            if libc::bind(fd, (&raw const sll).cast(), len) < 0 {
                return Err(io::Error::last_os_error());
            }
            let mut filter = port_filter(port);
            let program = libc::sock_fprog { len: filter.len() as libc::c_ushort, filter: filter.as_mut_ptr() };
            let size = std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t;
            if libc::setsockopt(fd, libc::SOL_SOCKET, SO_ATTACH_FILTER, (&raw const program).cast(), size) < 0 {
                return Err(io::Error::last_os_error());
            }
            let rcvbuf: libc::c_int = 64 << 20;
            let int = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, (&raw const rcvbuf).cast(), int);
            let timeout = libc::timeval { tv_sec: 0, tv_usec: 100_000 };
            let tv = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
            libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, (&raw const timeout).cast(), tv);
            Ok(capture)
        }
    }

    /// The next packet that arrived on `lo` (each is seen twice there: the outgoing copy is
    /// skipped); `None` after the receive timeout.
    #[allow(unsafe_code)] // One libc call: see the SAFETY note.
    fn next<'a>(&self, buf: &'a mut [u8]) -> Option<&'a [u8]> {
        // SAFETY: `buf` and `from` are locals of the sizes given; the kernel writes at most
        // that much into each.
        let (n, pkttype) = unsafe {
            let mut from: libc::sockaddr_ll = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
            let n = libc::recvfrom(self.0, buf.as_mut_ptr().cast(), buf.len(), 0, (&raw mut from).cast(), &mut len);
            (n, from.sll_pkttype)
        };
        if n <= 0 || pkttype == libc::PACKET_OUTGOING {
            return None;
        }
        Some(&buf[..n as usize])
    }
}

/// `SO_ATTACH_FILTER` (asm-generic's value, x86-64's and arm64's).
const SO_ATTACH_FILTER: libc::c_int = 26;

/// A classic BPF program for what `tcpdump 'ip and tcp port PORT'` takes, behind an Ethernet
/// header (`lo` has one): IPv4, TCP, the first fragment, source or destination port `port`.
/// The kernel runs it before it queues a packet or wakes the sniffer, so that the storms'
/// floods to P's side channel (every connection's SYN, HELLO, ERROR, FIN) cost the senders no
/// copy and the sniffer no wake-up, as a capture filter on a tap of the data network would.
fn port_filter(port: u16) -> Vec<libc::sock_filter> {
    let op = |code: u32, jt: u8, jf: u8, k: u32| libc::sock_filter { code: code as u16, jt, jf, k };
    let (ld, ldx, jmp, ret) = (libc::BPF_LD, libc::BPF_LDX, libc::BPF_JMP, libc::BPF_RET);
    let (h, b, abs, ind, msh, k) = (libc::BPF_H, libc::BPF_B, libc::BPF_ABS, libc::BPF_IND, libc::BPF_MSH, libc::BPF_K);
    let (jeq, jset) = (libc::BPF_JEQ, libc::BPF_JSET);
    let port = u32::from(port);
    // Jump offsets count the instructions skipped; 11 keeps the packet, 12 drops it.
    vec![
        op(ld | h | abs, 0, 0, 12),       // 0: the Ethernet type
        op(jmp | jeq | k, 0, 10, 0x0800), // 1: IPv4, else drop
        op(ld | b | abs, 0, 0, 23),       // 2: the IP protocol
        op(jmp | jeq | k, 0, 8, 6),       // 3: TCP, else drop
        op(ld | h | abs, 0, 0, 20),       // 4: flags and fragment offset
        op(jmp | jset | k, 6, 0, 0x1fff), // 5: a later fragment (no TCP header): drop
        op(ldx | b | msh, 0, 0, 14),      // 6: X = the IP header's length
        op(ld | h | ind, 0, 0, 14),       // 7: the source port
        op(jmp | jeq | k, 2, 0, port),    // 8: ours: keep
        op(ld | h | ind, 0, 0, 16),       // 9: the destination port
        op(jmp | jeq | k, 0, 1, port),    // 10: ours: keep, else drop
        op(ret | k, 0, 0, 0x0004_0000),   // 11: keep (up to 256 KiB of it)
        op(ret | k, 0, 0, 0),             // 12: drop
    ]
}

/// A TCP segment of an IPv4 packet behind `lo`'s 14-byte Ethernet header.
struct Segment<'a> {
    src: u16,
    dst: u16,
    seq: u32,
    syn: bool,
    payload: &'a [u8],
}

fn segment(frame: &[u8]) -> Option<Segment<'_>> {
    let ip = frame.get(14..)?;
    if frame.get(12..14)? != [0x08, 0x00] || ip.first()? >> 4 != 4 || *ip.get(9)? != 6 {
        return None;
    }
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([*ip.get(2)?, *ip.get(3)?]));
    let tcp = ip.get(ihl..total.min(ip.len()))?;
    let offset = usize::from(tcp.get(12)? >> 4) * 4;
    Some(Segment {
        src: u16::from_be_bytes([tcp[0], tcp[1]]),
        dst: u16::from_be_bytes([tcp[2], tcp[3]]),
        seq: u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]),
        syn: tcp.get(13)? & 0x02 != 0,
        payload: tcp.get(offset..)?,
    })
}

impl Recording {
    fn take(&mut self, s: &Segment<'_>) {
        if !self.flows.contains_key(&(s.src, s.dst)) && self.flows.len() >= MAX_FLOWS {
            // A flood's connections carry nothing: they give way to one that may.
            let Some(&empty) = self.flows.iter().find(|(_, f)| f.bytes.is_empty()).map(|(k, _)| k) else { return };
            self.flows.remove(&empty);
        }
        let flow = self.flows.entry((s.src, s.dst)).or_default();
        if s.syn {
            flow.next_seq = Some(s.seq.wrapping_add(1));
            flow.from_start = true;
            return;
        }
        if s.payload.is_empty() || flow.broken {
            return;
        }
        let next = *flow.next_seq.get_or_insert(s.seq);
        if s.seq == next {
            let room = FLOW_BYTES.saturating_sub(flow.bytes.len());
            flow.bytes.extend_from_slice(&s.payload[..s.payload.len().min(room)]);
            flow.next_seq = Some(next.wrapping_add(s.payload.len() as u32));
        } else if s.seq.wrapping_sub(next) < 1 << 31 {
            // A gap: the stream can no longer be followed.
            flow.broken = true;
        }
    }
}

impl Sniffer {
    /// Starts recording the TCP connections to or from `port` (P's data listener), or says
    /// why it cannot (not root).
    pub(super) fn start(port: u16) -> io::Result<Sniffer> {
        let capture = Capture::open(port)?;
        let (stop, recording) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(Recording::default())));
        let (s, r) = (stop.clone(), recording.clone());
        let thread = std::thread::spawn(move || {
            let mut buf = vec![0u8; 256 * 1024];
            while !s.load(Ordering::Relaxed) {
                if let Some(seg) = capture.next(&mut buf).and_then(segment) {
                    r.lock().unwrap_or_else(PoisonError::into_inner).take(&seg);
                }
            }
        });
        Ok(Sniffer { stop, recording, thread: Some(thread) })
    }

    /// Stops recording; the data links recorded from their first byte to `port`, and the READ
    /// ranges (P's pool addresses) seen on any stream to it.
    fn finish(mut self, port: u16) -> (Vec<Vec<u8>>, Vec<(u64, u64)>) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let recording = std::mem::take(&mut *self.recording.lock().unwrap_or_else(PoisonError::into_inner));
        let mut links = Vec::new();
        let mut ranges = Vec::new();
        for ((_, dst), flow) in recording.flows {
            if dst != port {
                continue;
            }
            let frames = frames(&flow.bytes, flow.from_start);
            ranges.extend(frames.iter().filter(|(kind, _)| *kind == 0x02).flat_map(|(_, body)| read_ranges(body)));
            if flow.from_start && frames.first().is_some_and(|(kind, _)| *kind == 0x01) {
                links.push(flow.bytes);
            }
        }
        (links, ranges)
    }
}

/// The frames at the start of a recorded stream to P's data listener: HELLO and PROOF, then
/// tagged frames (control, 16-byte tag, a chunk's data), as the TCP transport's docs lay them
/// out; it stops at the first one that does not fit.
fn frames(bytes: &[u8], from_start: bool) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = 0;
    if !from_start {
        return out;
    }
    while let Some(FrameHeader { kind, body_len: len }) = header_at(bytes, at) {
        let tagged = !matches!(kind, 0x01 | 0x06);
        let size = 5 + len + if tagged { 16 } else { 0 };
        if len > 2 << 20 || at + size > bytes.len() {
            break;
        }
        let control = if kind == 0x03 { 20 } else { len };
        out.push((kind, bytes[at + 5..at + 5 + control].to_vec()));
        at += size;
    }
    out
}

/// The (address, length) ranges of a READ frame's body.
fn read_ranges(body: &[u8]) -> Vec<(u64, u64)> {
    body.get(16..)
        .map(|ranges| {
            ranges
                .chunks_exact(16)
                .map(|r| {
                    let word = |i: usize| u64::from_le_bytes(r[i..i + 8].try_into().expect("8 bytes"));
                    (word(0), word(8))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Sends `bytes` on a fresh connection to `addr` and reads what comes back until P closes it
/// (or 7 s pass: P gives a HELLO naming a gone peer its 5 s handshake deadline): the kinds of
/// the frames P sent, and whether it closed.
fn replay(addr: SocketAddr, bytes: &[u8]) -> (Vec<u8>, bool) {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else { return (Vec::new(), false) };
    let _ = s.write_all(bytes);
    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
    let deadline = Instant::now() + Duration::from_secs(7);
    let mut got = Vec::new();
    let mut buf = [0u8; 64 * 1024];
    let closed = loop {
        match s.read(&mut buf) {
            Ok(0) => break true,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
            Err(_) => break true,
        }
        if Instant::now() >= deadline {
            break false;
        }
    };
    // Replies: CHALLENGE is untagged; anything after it would be tagged.
    let mut kinds = Vec::new();
    let mut at = 0;
    while let Some(FrameHeader { kind, body_len }) = header_at(&got, at) {
        kinds.push(kind);
        at += 5 + body_len + if kind == 0x84 { 0 } else { 16 };
    }
    (kinds, closed)
}

/// The header of the frame at `at`, if `bytes` hold one (the side channel's framing, which
/// the TCP data path shares).
fn header_at(bytes: &[u8], at: usize) -> Option<FrameHeader> {
    let head = bytes.get(at..at.checked_add(FrameHeader::BYTES)?)?;
    FrameHeader::from_bytes(head.try_into().ok()?)
}

/// A frame: header, body, and a tag of the sniffer's making (it has no key).
fn forged(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut out = FrameHeader { kind, body_len: body.len() }.to_bytes().to_vec();
    out.extend_from_slice(body);
    if !matches!(kind, 0x01 | 0x06) {
        out.extend_from_slice(&[0x5a; 16]);
    }
    out
}

impl Attacker {
    /// Replays the recorded links, and writes 0xEE at the recorded addresses under a HELLO
    /// naming the live D; P must answer nothing but CHALLENGE, and close each connection.
    pub(super) fn sniff_and_impersonate(&mut self, sniffer: io::Result<Sniffer>, data: SocketAddr) -> Result<Outcome> {
        let root_needed = || {
            let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
            Outcome {
                tried: "a sniffer on the data network (skipped: it needs root and a raw packet socket)".into(),
                held: !ci,
                detail: "not run".into(),
                probe_ms: None,
                peak_rss: self.rss_mib(),
                ..Outcome::default()
            }
        };
        let sniffer = match sniffer {
            Ok(s) => s,
            Err(e) => {
                let mut o = root_needed();
                o.detail = format!("no raw packet socket: {e}{}", if o.held { "" } else { " (CI runs as root)" });
                o.probe_ms = self.probe();
                return Ok(o);
            }
        };
        let (links, ranges) = sniffer.finish(data.port());
        let refused_before = self.p_data_refusals();
        // Whole links, verbatim, and one connection of forged writes, all at once.
        let mut attempts: Vec<Vec<u8>> = links.iter().take(8).cloned().collect();
        let mut frames_sent: u64 = attempts.iter().map(|l| frames(l, true).len() as u64).sum();
        // Writes of 0xEE where P's pool is, under the live D's name.
        let mut hello_body = b"KVTD\x03\x00".to_vec();
        hello_body.extend_from_slice(&[0x11; 32]);
        hello_body.extend_from_slice(&self.config.live_instance.to_le_bytes());
        hello_body.extend_from_slice(&0u32.to_le_bytes());
        hello_body.extend_from_slice(self.config.live_decode.as_bytes());
        let mut bytes = forged(0x01, &hello_body);
        bytes.extend(forged(0x06, &[0; 32]));
        let mut written = 0u64;
        for (i, &(addr, len)) in ranges.iter().take(64).enumerate() {
            let mut chunk = (i as u64).to_le_bytes().to_vec();
            chunk.extend_from_slice(&0u32.to_le_bytes());
            chunk.extend_from_slice(&addr.to_le_bytes());
            let mut frame = forged(0x03, &chunk);
            // The data follows the chunk's tag.
            let body_len = 20 + len.min(4096) as usize;
            frame[..FrameHeader::BYTES].copy_from_slice(&FrameHeader { kind: 0x03, body_len }.to_bytes());
            frame.extend(std::iter::repeat_n(0xee, len.min(4096) as usize));
            bytes.extend(frame);
            written += 1;
        }
        frames_sent += 2 + written;
        attempts.push(bytes);
        let connections = attempts.len() as u64;
        let answers: Vec<(Vec<u8>, bool)> = std::thread::scope(|scope| {
            let replays: Vec<_> = attempts.iter().map(|bytes| scope.spawn(move || replay(data, bytes))).collect();
            replays.into_iter().map(|r| r.join().unwrap_or_default()).collect()
        });
        let served: Vec<String> = answers
            .iter()
            .filter(|(kinds, closed)| kinds.iter().any(|&k| k != 0x84) || !closed)
            .map(|(kinds, closed)| format!("a replay got frames {kinds:02x?} (closed: {closed})"))
            .collect();
        let refused = self.p_data_refusals().zip(refused_before).map(|(after, before)| after - before);
        let counted = refused.is_none_or(|r| r >= connections);
        let (probe_ms, peak_rss) = self.measure();
        Ok(Outcome {
            tried: format!(
                "recorded {} whole data links and {} READ ranges of P's pool on the wire; replayed the links and wrote 0xEE at the ranges as {} ({} connections, {frames_sent} frames)",
                links.len(),
                ranges.len(),
                self.config.live_decode,
                connections
            ),
            held: served.is_empty() && counted && !links.is_empty(),
            detail: format!(
                "{}; P's data listener counted {} refusals meanwhile{}",
                if served.is_empty() { "P answered nothing but CHALLENGE and closed every one".to_owned() } else { served.join("; ") },
                refused.map_or("(no metrics endpoint)".to_owned(), |r| r.to_string()),
                if links.is_empty() { "; no whole link was recorded, so nothing was replayed" } else { "" }
            ),
            probe_ms,
            peak_rss,
            ..Outcome::default()
        })
    }

    /// P's data listener's refusals, every cause, from its metrics endpoint.
    fn p_data_refusals(&self) -> Option<u64> {
        let port = self.config.metrics_port?;
        let text = crate::prometheus::scrape(SocketAddr::from(([127, 0, 0, 1], port)), Duration::from_secs(5)).ok()?;
        let exposition = crate::prometheus::Exposition::parse(&text).ok()?;
        Some(exposition.sum("kvflow_connections_refused_total", &[("listener", "data")]) as u64)
    }
}
