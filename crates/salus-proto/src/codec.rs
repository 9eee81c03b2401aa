//! The protobuf codec of the salus services.
//!
//! prost's codec, except for one answer: a message that cannot be decoded is the sender's
//! mistake, so it is `INVALID_ARGUMENT` (as docs/api.md promises), not the `INTERNAL` that
//! tonic gives by default, which reads like a fault of the daemon. Both the services and
//! the generated clients use it; a daemon never sends an undecodable message, so clients
//! see the difference only in tests that make one.

use std::marker::PhantomData;

use tonic::Status;
use tonic::codec::{BufferSettings, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstDecoder};

/// [`ProstCodec`] with undecodable messages answered `INVALID_ARGUMENT`.
#[derive(Debug, Clone)]
pub struct SalusCodec<T, U> {
    _messages: PhantomData<(T, U)>,
}

impl<T, U> Default for SalusCodec<T, U> {
    fn default() -> Self {
        SalusCodec {
            _messages: PhantomData,
        }
    }
}

/// prost's decoder, with its errors as `INVALID_ARGUMENT` naming the message type.
#[derive(Debug, Clone, Default)]
pub struct SalusDecoder<U> {
    inner: ProstDecoder<U>,
}

impl<U: prost::Message + Default> Decoder for SalusDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.inner.decode(buf).map_err(|status| {
            let name = std::any::type_name::<U>()
                .rsplit("::")
                .next()
                .unwrap_or("message");
            Status::invalid_argument(format!(
                "a {name} message could not be decoded: {}",
                status.message()
            ))
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.inner.buffer_settings()
    }
}

impl<T, U> tonic::codec::Codec for SalusCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = <ProstCodec<T, U> as tonic::codec::Codec>::Encoder;
    type Decoder = SalusDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::default().encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        SalusDecoder {
            inner: ProstCodec::<T, U>::default().decoder(),
        }
    }
}
