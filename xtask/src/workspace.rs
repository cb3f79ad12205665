//! The workspace and cargo as every task uses them: where the workspace and its target folder
//! are, and cargo invoked through `$CARGO` (the cargo that runs `cargo xtask`), so that a task
//! builds with the same toolchain.
//!
//! Tasks depend on this module, never on each other for it, so that the module graph has no
//! cycle: `ci` runs `demo`, `demo` and `bench` use `provision`, and all of them use this.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The workspace root: the parent of this crate's manifest folder.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace root").to_path_buf()
}

/// Cargo's target folder: `CARGO_TARGET_DIR`, else `target` under `root`.
pub fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"))
}

/// `$CARGO args...` in `root` with the extra environment `envs`, its command line printed to
/// stderr; the caller runs it.
pub fn cargo_command(root: &Path, args: &[&str], envs: &[(String, String)]) -> Command {
    eprintln!("xtask: cargo {}", args.join(" "));
    let mut command = Command::new(cargo_bin());
    command.args(args).envs(envs.iter().map(|(k, v)| (k, v))).current_dir(root);
    command
}

/// Runs `$CARGO args...` in `root`, failing with the command line when it fails.
pub fn cargo(root: &Path, args: &[&str]) -> Result<()> {
    cargo_env(root, args, &[])
}

/// Runs `$CARGO args...` in `root` with the extra environment `envs`, failing with the command
/// line when it fails.
pub fn cargo_env(root: &Path, args: &[&str], envs: &[(String, String)]) -> Result<()> {
    run_cargo(cargo_command(root, args, envs), args)
}

/// Runs `command`, the `$CARGO args...` of [`cargo_command`], failing with the command line
/// when it fails.
pub fn run_cargo(mut command: Command, args: &[&str]) -> Result<()> {
    let status = command.status().with_context(|| format!("cannot start {}", cargo_bin()))?;
    if !status.success() {
        bail!("`cargo {}` failed ({status})", args.join(" "));
    }
    Ok(())
}

/// The cargo that runs this task: `$CARGO`, else `cargo` from `PATH`.
pub fn cargo_bin() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}
