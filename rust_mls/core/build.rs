//! Generates the relay's tonic client from `proto/relay.proto`, the one source of truth of the
//! protocol, with the vendored protoc (nothing is downloaded at build time).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "../../proto/relay.proto";
    println!("cargo:rerun-if-changed={proto}");
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY-free in edition 2021: build scripts are single-threaded here.
    std::env::set_var("PROTOC", protoc);
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_protos(&[proto], &["../../proto"])?;
    Ok(())
}
