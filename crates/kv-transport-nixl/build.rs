//! Compiles in where `cargo xtask setup` unpacks the NIXL runtime, so that nothing needs exporting.

fn main() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let default = std::path::Path::new(&manifest).join("../../.nixl/nixl_cu12-1.5.1/.nixl_cu12.mesonpy.libs");
    println!("cargo:rustc-env=KVFLOW_NIXL_DEFAULT_DIR={}", default.display());
    println!("cargo:rerun-if-changed=build.rs");
}
