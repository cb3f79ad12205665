//! Logging for the harness's binaries: `tracing` events to stderr, filtered by `RUST_LOG` (for
//! example `RUST_LOG=kv_sched_adapter=debug`); warnings and errors when it is unset. Only
//! binaries install a subscriber: the libraries emit events and leave the choice to the
//! engine that embeds them.

use tracing_subscriber::EnvFilter;

/// Installs the subscriber, once; a second call, or one after another subscriber, does nothing.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    // Colour only on a terminal, and never where NO_COLOR is set (no-color.org).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none();
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).try_init();
}
