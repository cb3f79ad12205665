//! The attacker process of `cargo xtask attack`. See `xtask::attacker`.

fn main() -> std::process::ExitCode {
    xtask::attacker::main()
}
