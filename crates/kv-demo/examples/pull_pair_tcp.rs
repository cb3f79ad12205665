//! The `pull_pair` engines over plain TCP (kv-transport-tcp), the baseline transport: the
//! same side-channel handshake as NIXL's, and the bytes on sockets of its own.
//! `cargo run -p kv-demo --features nixl --example pull_pair_tcp` (the feature brings kv-cuda's
//! host memory; TCP needs no NIXL runtime).

mod pair;

use kv_core::PeerAddress;
use kv_transport_tcp::{TcpConfig, TcpTransport};

fn main() -> pair::Fallible<()> {
    let config = TcpConfig { bind: "127.0.0.1:0".parse()?, ..TcpConfig::default() };
    pair::pull_pair(&mut pair::Sockets::new(|offer, clock| {
        let transport = TcpTransport::new(offer.clone(), &config, clock)?;
        let address = PeerAddress(transport.side_channel_addr().to_string());
        Ok((Box::new(transport), address))
    }))
}
