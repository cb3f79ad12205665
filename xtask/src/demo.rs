//! `cargo xtask demo`, `cargo xtask attack` and `cargo xtask soak`: provisions NIXL, builds kv-demo's engine
//! binaries (its `nixl` feature), and runs kv-demo's router with them.

use std::path::PathBuf;

use anyhow::{Context, Result};
pub use kv_demo::demo::{AttackArgs, DemoArgs, NodeBinary, SoakArgs};

use crate::{provision, workspace};

/// Provisions NIXL and builds `kvflow-node` (and `kvflow-watch`, the router's watch on etcd);
/// returns its path and the environment it needs.
/// `KVFLOW_NODE_BIN` names a `kvflow-node` built elsewhere instead (for a machine without a
/// toolchain, with `KVFLOW_NIXL_DIR` pointing at its runtime).
pub fn build_node() -> Result<NodeBinary> {
    if let Some(path) = std::env::var_os("KVFLOW_NODE_BIN") {
        return Ok(NodeBinary::new(PathBuf::from(path), Vec::new()));
    }
    let nixl = provision::ensure().context("the demo's engines need NIXL (see `cargo xtask setup`)")?;
    let envs = nixl.envs();
    build(&["kvflow-node", "kvflow-watch"], &envs)?;
    let target = workspace::target_dir(&workspace::root());
    Ok(NodeBinary::new(target.join("debug").join("kvflow-node"), envs))
}

/// Builds kv-demo's binaries `bins`, which need the `nixl` feature, with the provisioned `envs`.
fn build(bins: &[&str], envs: &[(String, String)]) -> Result<()> {
    let mut args = vec!["build", "--locked", "-q", "-p", "kv-demo", "--features", "nixl"];
    for bin in bins {
        args.extend(["--bin", bin]);
    }
    workspace::cargo_env(&workspace::root(), &args, envs)
}

/// `cargo xtask demo`.
pub fn run(args: &DemoArgs) -> Result<()> {
    kv_demo::demo::run(args, &build_node()?)
}

/// `cargo xtask attack`: kv-demo's runs, with the attacker built beside the engine.
pub fn attack(args: &AttackArgs) -> Result<()> {
    let node = build_node()?;
    if std::env::var_os("KVFLOW_NODE_BIN").is_none() {
        let nixl = provision::ensure()?;
        build(&["kvflow-attack"], &nixl.envs())?;
    }
    kv_demo::demo::attack(args, &node)
}

/// `cargo xtask soak`.
pub fn soak(args: &SoakArgs) -> Result<()> {
    kv_demo::demo::soak(args, &build_node()?)
}
