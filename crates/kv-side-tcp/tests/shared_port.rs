//! One side-channel port shared by a prefill engine's two TP ranks, each in a process of its
//! own: rank 0's process accepts and hands rank 1's connections to rank 1's process. Decode
//! ranks reach each P rank through the one port; a rank that is gone is named in the refusal;
//! rank 1 killed is seen lost, and a restarted rank 1 is reached again.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{free_port, outcome, start};
use kv_core::{PeerAddress, Role};
use kv_side_tcp::{Item, PortPlan, SideChannel};

/// Set in the child process: the shared port it serves as P's rank 1.
const CHILD: &str = "KVFLOW_SHARED_PORT_CHILD";

fn prefill_rank(port: SocketAddr, rank: u32, instance: u64) -> SideChannel {
    let plan = PortPlan::Shared { accept: rank == 0 };
    let side = start(port, plan, "prefill", Role::Prefill, rank, instance).expect("P rank starts on the shared port");
    assert_eq!(side.address(), &PeerAddress::of_rank(&port.to_string(), rank));
    side
}

fn decode_rank(engine: &str, rank: u32) -> SideChannel {
    start("127.0.0.1:0".parse().unwrap(), PortPlan::Own, engine, Role::Decode, rank, 1).expect("D rank starts")
}

/// The child: P's rank 1 on the shared port, until killed (answering items as a transport does).
#[test]
fn child_prefill_rank_one() {
    let Ok(port) = std::env::var(CHILD) else { return };
    let instance = std::env::var("KVFLOW_SHARED_PORT_INSTANCE").unwrap().parse().unwrap();
    let side = prefill_rank(port.parse().unwrap(), 1, instance);
    println!("ready");
    std::io::stdout().flush().unwrap();
    loop {
        match side.poll_item() {
            Some(Item::PeerClosed(conn)) => side.peer_closed(conn),
            Some(_) => {}
            None => std::thread::sleep(Duration::from_millis(2)),
        }
    }
}

fn spawn_rank_one(port: SocketAddr, instance: u64) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_prefill_rank_one", "--nocapture", "--test-threads", "1"])
        .env(CHILD, port.to_string())
        .env("KVFLOW_SHARED_PORT_INSTANCE", instance.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .expect("child starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = lines.any(|line| line.map(|l| l.contains("ready")).unwrap_or(false));
    assert!(ready, "P's rank 1 did not start");
    child
}

#[test]
fn an_engines_ranks_share_one_port_across_processes() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let port = free_port();
    let p0 = prefill_rank(port, 0, 1);
    let mut p1 = spawn_rank_one(port, 1);
    assert_eq!(p0.local_addr(), port);
    let (d0, d1) = (decode_rank("decode", 0), decode_rank("decode", 1));

    // Each D rank reaches the P rank it names, through the one port.
    d0.connect(&PeerAddress::of_rank(&port.to_string(), 0)).unwrap();
    assert_eq!(outcome(&d0), "connected prefill/tp0");
    d1.connect(&PeerAddress::of_rank(&port.to_string(), 1)).unwrap();
    assert_eq!(outcome(&d1), "connected prefill/tp1");

    // An address that names no rank, or a rank the engine does not have, is refused by name.
    let d2 = decode_rank("decode-b", 1);
    d2.connect(&PeerAddress(port.to_string())).unwrap();
    let text = outcome(&d2);
    assert!(text.contains("must name one"), "{text}");
    d2.connect(&PeerAddress::of_rank(&port.to_string(), 5)).unwrap();
    let text = outcome(&d2);
    assert!(text.contains("Prefill rank 5") && text.contains("does not listen"), "{text}");

    // Rank 1's process killed: D's rank 1 sees it lost, and a new connection is told it is gone,
    // while rank 0 (in this process) still serves.
    p1.kill().unwrap();
    p1.wait().unwrap();
    assert_eq!(outcome(&d1), "lost prefill/tp1");
    d2.connect(&PeerAddress::of_rank(&port.to_string(), 1)).unwrap();
    let text = outcome(&d2);
    assert!(text.contains("Prefill rank 1") && text.contains("its process is gone"), "{text}");
    let d3 = decode_rank("decode-c", 0);
    d3.connect(&PeerAddress::of_rank(&port.to_string(), 0)).unwrap();
    assert_eq!(outcome(&d3), "connected prefill/tp0");

    // Rank 1 restarted (a new incarnation) takes its name back at once and is reached again.
    let mut p1 = spawn_rank_one(port, 2);
    d1.connect(&PeerAddress::of_rank(&port.to_string(), 1)).unwrap();
    assert_eq!(outcome(&d1), "connected prefill/tp1");
    p1.kill().unwrap();
    p1.wait().unwrap();
    drop(p0);
}

#[test]
fn a_rank_taken_on_this_host_or_port_zero_fails_by_name() {
    if std::env::var(CHILD).is_ok() {
        return;
    }
    let port = free_port();
    let _p0 = prefill_rank(port, 0, 1);
    let plan = |accept| PortPlan::Shared { accept };
    let again = start(port, plan(false), "prefill", Role::Prefill, 0, 2);
    let error = again.err().expect("rank 0 is taken").to_string();
    assert!(error.contains("Prefill rank 0") && error.contains("taken"), "{error}");
    let zero = "127.0.0.1:0".parse().unwrap();
    let error = start(zero, plan(true), "prefill", Role::Prefill, 1, 1).err().expect("port 0 is refused").to_string();
    assert!(error.contains("must be given"), "{error}");
}
