//! An engine process of `cargo xtask demo` and the end-to-end bench: P or D, as its JSON
//! argument says. See `kv_demo::node`.

fn main() -> std::process::ExitCode {
    kv_demo::node::main()
}
