//! `cargo xtask ci`: what CI runs, in the order that fails fastest.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// Runs the fmt check, clippy with `-D warnings`, and every test of the workspace.
pub fn run(args: &[String]) -> Result<()> {
    if let Some(arg) = args.first() {
        bail!("cargo xtask ci takes no arguments, got {arg:?}");
    }
    let root = workspace_root();
    cargo(&root, &["fmt", "--all", "--", "--check"])?;
    cargo(&root, &["clippy", "--workspace", "--all-targets", "--locked", "--", "-D", "warnings"])?;
    cargo(&root, &["test", "--workspace", "--locked"])?;
    Ok(())
}

/// The workspace root: the parent of this crate's manifest folder.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace root").to_path_buf()
}

/// Runs `$CARGO args...` in `root`, failing with the command line when it fails.
pub fn cargo(root: &Path, args: &[&str]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    eprintln!("xtask: cargo {}", args.join(" "));
    let status =
        Command::new(&cargo).args(args).current_dir(root).status().with_context(|| format!("cannot start {cargo}"))?;
    if !status.success() {
        bail!("`cargo {}` failed ({status})", args.join(" "));
    }
    Ok(())
}
