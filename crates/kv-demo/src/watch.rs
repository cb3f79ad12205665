//! `kvflow-watch`: the router's eyes on the run's etcd registry. It watches every engine
//! record under the run's prefix and reports each change as a [`Sighting`] line on stdout,
//! until stdin closes (the router is gone) or it is killed. The router runs it beside the
//! engines with `--discovery etcd`: it waits for every engine to be published before the
//! workload starts, stops routing to an engine whose registration is gone, and times a silent
//! death from the cut of its network to the lapse.

use std::io::BufRead;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use kv_core::discovery::{Change, Discovery};
use kv_discovery_etcd::EtcdDiscovery;

use crate::proto::{from_json, wall_ns, write_line, EtcdSettings, Sighting};

/// `kvflow-watch`'s argument.
#[derive(Parser, Debug)]
#[command(name = "kvflow-watch", about = "Reports the engines of a run's etcd registry as they come and go")]
struct Args {
    /// The registry, `kv_demo::proto::EtcdSettings` as JSON.
    #[arg(value_name = "SETTINGS", value_parser = from_json::<EtcdSettings>)]
    settings: EtcdSettings,
}

/// Watches until stdin closes; the exit code says whether the watch could start.
pub fn main() -> ExitCode {
    let Args { settings } = Args::parse();
    crate::logging::init();
    // The router closing our stdin means the run is over.
    std::thread::spawn(|| {
        for line in std::io::stdin().lock().lines() {
            if line.is_err() {
                break;
            }
        }
        std::process::exit(0);
    });
    match run(settings) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let message = format!("{err:#}");
            let _ = write_line(&mut std::io::stdout(), &Sighting::Error { message: message.clone() });
            eprintln!("kvflow-watch: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(settings: EtcdSettings) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().context("a tokio runtime")?;
    runtime.block_on(async {
        let discovery = EtcdDiscovery::connect(settings.config()).await.context("connecting to etcd")?;
        let mut watch = discovery.watch().await.context("watching etcd")?;
        let mut out = std::io::stdout();
        write_line(&mut out, &Sighting::Watching)?;
        loop {
            let sighting = match watch.next().await {
                Ok(Change::Up(record)) => Sighting::Up {
                    engine: record.engine.to_string(),
                    instance: record.instance,
                    addresses: record.addresses,
                    at_ns: wall_ns(),
                },
                Ok(Change::Down { engine, instance }) => {
                    Sighting::Down { engine: engine.to_string(), instance, at_ns: wall_ns() }
                }
                Err(kv_core::discovery::DiscoveryError::Closed) => return Ok(()),
                Err(e) => Sighting::Error { message: e.to_string() },
            };
            write_line(&mut out, &sighting)?;
        }
    })
}
