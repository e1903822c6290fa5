//! Generates the relay's tonic server (and, for the tests, a client) from `proto/relay.proto`,
//! the one source of truth of the protocol, with the vendored protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "../../proto/relay.proto";
    println!("cargo:rerun-if-changed={proto}");
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .build_transport(false)
        .bytes(".")
        // The descriptor goes into the extension too (`static-relay`'s `PROTO_DESCRIPTOR`): the
        // Python server builds its protobuf messages from it, so nothing generated is shipped.
        .file_descriptor_set_path(
            std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("relay_descriptor.bin"),
        )
        .compile_protos(&[proto], &["../../proto"])?;
    Ok(())
}
