//! `cargo xtask ci`: what CI runs, in the order that fails fastest.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::provision;

/// Runs the fmt check, provisions libclang and the NIXL runtime (see [`provision::ensure`]),
/// then clippy with `-D warnings` and every test of the workspace, with the provisioned paths in
/// their environment, `cargo package` of every library crate, then a short demo in each mode
/// and the attack suite.
pub fn run(args: &[String]) -> Result<()> {
    if let Some(arg) = args.first() {
        bail!("cargo xtask ci takes no arguments, got {arg:?}");
    }
    let root = workspace_root();
    cargo(&root, &["fmt", "--all", "--", "--check"])?;
    let nixl = provision::ensure().context("cannot provision what nixl-sys needs (see `cargo xtask setup`)")?;
    let envs = nixl.envs();
    for (key, value) in &envs {
        eprintln!("xtask: {key}={value}");
    }
    // The `nixl` feature adds what needs both adapters: the demo's engine binary, and the
    // test and bench of kv-cuda's pools moved by NixlTransport.
    let clippy =
        ["clippy", "--workspace", "--all-targets", "--locked", "--features", "xtask/nixl", "--", "-D", "warnings"];
    cargo_env(&root, &clippy, &envs)?;
    cargo_env(&root, &["test", "--workspace", "--locked", "--features", "xtask/nixl"], &envs)?;
    // Every library crate packages and builds from its package, as a user's dependency would.
    cargo_env(&root, &["package", "--workspace", "--exclude", "xtask", "--locked", "--allow-dirty"], &envs)?;
    // A short demo in each mode, real processes over NIXL: any corrupt read, block written after
    // free, or block held after the drain fails it.
    for mode in ["pull", "push"] {
        eprintln!("xtask: cargo xtask demo --mode {mode} (short)");
        let args: Vec<String> =
            ["--mode", mode, "--requests", "40", "--layers", "4", "--max-tokens", "256", "--lease-ms", "2000"]
                .into_iter()
                .map(String::from)
                .collect();
        crate::demo::run(&args).with_context(|| format!("the short {mode} demo"))?;
    }
    // The engines under attack, and stopped past their lease, in both modes (about a minute).
    eprintln!("xtask: cargo xtask attack");
    crate::demo::attack(&[]).context("the attack suite")?;
    Ok(())
}

/// The workspace root: the parent of this crate's manifest folder.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace root").to_path_buf()
}

/// Runs `$CARGO args...` in `root`, failing with the command line when it fails.
pub fn cargo(root: &Path, args: &[&str]) -> Result<()> {
    cargo_env(root, args, &[])
}

/// Runs `$CARGO args...` in `root` with the extra environment `envs`, failing with the command
/// line when it fails.
pub fn cargo_env(root: &Path, args: &[&str], envs: &[(String, String)]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    eprintln!("xtask: cargo {}", args.join(" "));
    let status = Command::new(&cargo)
        .args(args)
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .current_dir(root)
        .status()
        .with_context(|| format!("cannot start {cargo}"))?;
    if !status.success() {
        bail!("`cargo {}` failed ({status})", args.join(" "));
    }
    Ok(())
}
