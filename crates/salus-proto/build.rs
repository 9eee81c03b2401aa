//! Generates the Rust types and gRPC services of `proto/salus/v1/*.proto` with protox (a
//! protobuf compiler in Rust), so building needs no `protoc` binary.

use std::error::Error;

fn main() -> Result<(), Box<dyn Error>> {
    let proto_root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../proto");
    let files = [
        "salus/v1/graph.proto",
        "salus/v1/session.proto",
        "salus/v1/admin.proto",
    ];
    let descriptors = protox::compile(files, [proto_root])?;
    // Undecodable requests are INVALID_ARGUMENT, not tonic's INTERNAL (`codec.rs`).
    tonic_prost_build::configure()
        .codec_path("crate::codec::SalusCodec")
        .compile_fds(descriptors)?;
    println!("cargo:rerun-if-changed={proto_root}");
    Ok(())
}
