//! Requests the fuzz targets (`fuzz/`, `docs/operations.md`, "Fuzzing") found salusd
//! answering wrongly, each against a real daemon.

#![allow(clippy::unwrap_used)]

mod common;

use common::Daemon;
use tonic::Code;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::{Status, Streaming};

/// Sends each `Vec<u8>` as one message, as is; hands answers back as bytes.
#[derive(Clone, Copy)]
struct Raw;

impl Encoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        bytes::BufMut::put_slice(buf, &item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        use bytes::Buf;
        let mut out = vec![0; buf.remaining()];
        buf.copy_to_slice(&mut out);
        Ok(Some(out))
    }
}

impl Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;

    fn encoder(&mut self) -> Raw {
        Raw
    }

    fn decoder(&mut self) -> Raw {
        Raw
    }
}

/// Calls `path` with `messages` as its request stream.
async fn call(
    channel: tonic::transport::Channel,
    path: &'static str,
    messages: Vec<Vec<u8>>,
) -> Result<Streaming<Vec<u8>>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    grpc.streaming(
        tonic::Request::new(tokio_stream::iter(messages)),
        tonic::codegen::http::uri::PathAndQuery::from_static(path),
        Raw,
    )
    .await
    .map(tonic::Response::into_inner)
}

/// A unary call whose request stream ends without its message was answered INTERNAL (from
/// tonic's generated server: "Missing request message."), which says salusd is at fault;
/// it is INVALID_ARGUMENT naming the method now, on both services, for unary and
/// server-streaming methods alike. A call with its message still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unary_call_without_its_message_is_invalid_argument() {
    let daemon = Daemon::start(&["--device", "cpu"]);
    let client = daemon.client().await;
    for path in [
        "/salus.v1.Sessions/Run",
        "/salus.v1.Sessions/ReadTensors",
        "/salus.v1.Sessions/Close",
        "/salus.v1.Sessions/AddProgram",
        "/salus.v1.Sessions/AttachBuffer",
        "/salus.v1.Admin/Status",
        "/salus.v1.Admin/ListSessions",
        "/salus.v1.Admin/SetPolicy",
        "/salus.v1.Admin/Drain",
        "/salus.v1.Admin/Watch",
    ] {
        let status = match call(client.channel(), path, Vec::new()).await {
            Ok(mut answers) => answers.message().await.unwrap_err(),
            Err(status) => status,
        };
        assert_eq!(status.code(), Code::InvalidArgument, "{path}: {status:?}");
        assert!(
            status.message().contains(path) && status.message().contains("no message"),
            "{path}: {}",
            status.message()
        );
    }
    let mut answers = call(client.channel(), "/salus.v1.Admin/Status", vec![Vec::new()])
        .await
        .unwrap();
    assert!(answers.message().await.unwrap().is_some());
}
