//! Compiles `proto/relay.proto`, the one source of truth of the protocol, once for both sides:
//! the messages (byte fields as `bytes::Bytes`), the tonic client and server (transport-free:
//! each side brings its own), and the descriptor set, with the vendored protoc (nothing is
//! downloaded at build time).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "../../proto/relay.proto";
    println!("cargo:rerun-if-changed={proto}");
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // Build scripts are single-threaded here.
    std::env::set_var("PROTOC", protoc);
    let descriptor = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("relay.bin");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .build_transport(false)
        .bytes(".")
        .file_descriptor_set_path(descriptor)
        .compile_protos(&[proto], &["../../proto"])?;
    Ok(())
}
