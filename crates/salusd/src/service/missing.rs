//! The one answer tonic gives for salusd that salusd gives differently: a unary call whose
//! request stream carries no message. tonic's generated server answers it `INTERNAL`
//! ("Missing request message."), which reads as a fault of salusd (docs/api.md); it is the
//! client's mistake, so salusd answers `INVALID_ARGUMENT` naming the method. Found by the
//! `rpc` fuzz target.

use std::convert::Infallible;

use tonic::body::Body;
use tonic::codegen::{Context, Future, Pin, Poll, Service, http};
use tonic::server::NamedService;
use tonic::{Code, Status};

/// What tonic says when a unary call brings no message.
const TONIC_MISSING: &str = "Missing request message.";

/// A gRPC service whose answer to a unary call without its message is `INVALID_ARGUMENT`.
#[derive(Debug, Clone)]
pub struct AnswerMissingMessage<S> {
    inner: S,
}

impl<S> AnswerMissingMessage<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> AnswerMissingMessage<S> {
        AnswerMissingMessage { inner }
    }
}

impl<S: NamedService> NamedService for AnswerMissingMessage<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> Service<http::Request<B>> for AnswerMissingMessage<S>
where
    S: Service<http::Request<B>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let method = request.uri().clone();
        let answer = self.inner.call(request);
        Box::pin(async move {
            let mut response = answer.await?;
            // Errors before the handler runs come back as headers (a trailers-only answer);
            // a successful answer has no status there.
            if let Some(status) = Status::from_header_map(response.headers())
                && status.code() == Code::Internal
                && status.message() == TONIC_MISSING
            {
                let headers = response.headers_mut();
                headers.remove(Status::GRPC_MESSAGE);
                let _ = Status::invalid_argument(format!(
                    "{}: the request carried no message (a unary call takes exactly one)",
                    method.path()
                ))
                .add_header(headers);
            }
            Ok(response)
        })
    }
}
