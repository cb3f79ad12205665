//! The attacker process of `cargo xtask attack`. See `kv_demo::attacker`.

fn main() -> std::process::ExitCode {
    kv_demo::attacker::main()
}
