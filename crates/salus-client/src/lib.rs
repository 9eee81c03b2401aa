//! The Rust client of `salusd`: what `salusctl`, the benchmarks and the tests use.
//!
//! Owns finding the daemon (an address argument, `SALUS_ADDRESS`, or the default socket
//! path), authenticating over TCP (a bearer token; TLS for `https://` addresses, trusting
//! the CA certificate `SALUS_TLS_CA` names), and the shape
//! of a session's life: [`Client::open`] uploads the graph and initial tensors in chunks
//! and holds the session's lease (the `Open` stream) until [`Session::close`] or drop.
//!
//! The conventions both ends share (the default socket path, message and chunk sizes, the
//! bearer-token header) live in `salus_proto::wire` and are re-exported here.
//!
//! ```no_run
//! # async fn demo(graph: salus_proto::v1::Graph) -> Result<(), salus_client::Error> {
//! let client = salus_client::Client::connect(&salus_client::address_from_env()).await?;
//! let mut session = client.open(salus_client::OpenOptions::training(graph)).await?;
//! session.admitted().await?;
//! let out = session.run(vec![vec![0u8; 16]]).await?;
//! println!("{} fetches", out.fetches.len());
//! session.close().await?;
//! # Ok(()) }
//! ```

use salus_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

pub use salus_proto::v1;

pub use salus_proto::wire::{
    ADDRESS_ENV, Address, CHUNK_BYTES, MAX_MESSAGE_BYTES, TLS_CA_ENV, TOKEN_FILE_ENV, chunks,
    current_uid, default_socket_path,
};

/// What went wrong talking to the daemon.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The daemon could not be reached.
    #[error("cannot reach salusd at {address}: {message}")]
    Connect {
        /// Where we looked.
        address: String,
        /// Why it failed.
        message: String,
    },
    /// The daemon answered with an error.
    #[error("salusd: {}: {}", code_name(.0.code()), .0.message())]
    Status(#[from] tonic::Status),
    /// The daemon said something this client does not expect.
    #[error("protocol: {0}")]
    Protocol(String),
}

fn code_name(code: tonic::Code) -> String {
    format!("{code:?}")
}

/// `SALUS_ADDRESS` if set, else the default socket path.
pub fn address_from_env() -> String {
    std::env::var(ADDRESS_ENV)
        .ok()
        .filter(|a| !a.is_empty())
        .unwrap_or_else(|| default_socket_path().display().to_string())
}

/// Options of a new session.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// The session's graph.
    pub graph: pb::Graph,
    /// Training or inference.
    pub kind: pb::SessionKind,
    /// Name, priority, total iterations, expected iteration time.
    pub hints: pb::Hints,
    /// Initial values of the PARAMETER and STATE tensors: (tensor id, bytes).
    pub initial: Vec<(u32, Vec<u8>)>,
}

impl OpenOptions {
    /// A training session of `graph` with no hints and no initial values yet.
    pub fn training(graph: pb::Graph) -> OpenOptions {
        OpenOptions {
            graph,
            kind: pb::SessionKind::Training,
            hints: pb::Hints::default(),
            initial: Vec::new(),
        }
    }
}

/// A connection to one daemon.
#[derive(Clone)]
pub struct Client {
    channel: Channel,
    token: Option<String>,
}

impl Client {
    /// Connects to `address` (see [`Address::parse`]); the token comes from the file named
    /// by `SALUS_TOKEN_FILE`, when set.
    pub async fn connect(address: &str) -> Result<Client, Error> {
        let token = match std::env::var_os(TOKEN_FILE_ENV) {
            Some(path) => Some(
                std::fs::read_to_string(&path)
                    .map_err(|e| Error::Connect {
                        address: address.to_string(),
                        message: format!("reading the token file {}: {e}", path.display()),
                    })?
                    .trim()
                    .to_string(),
            ),
            None => None,
        };
        Client::connect_with_token(address, token).await
    }

    /// Connects to `address`, sending `token` as a bearer token with every call; an
    /// `https://` address trusts the CA certificate `SALUS_TLS_CA` names.
    pub async fn connect_with_token(address: &str, token: Option<String>) -> Result<Client, Error> {
        let tls_ca = std::env::var_os(TLS_CA_ENV).map(std::path::PathBuf::from);
        Client::connect_with(address, token, tls_ca.as_deref()).await
    }

    /// Connects to `address`, sending `token` as a bearer token with every call; an
    /// `https://` address trusts the CA certificate (PEM) in the file `tls_ca`.
    pub async fn connect_with(
        address: &str,
        token: Option<String>,
        tls_ca: Option<&std::path::Path>,
    ) -> Result<Client, Error> {
        let fail = |message: String| Error::Connect {
            address: address.to_string(),
            message,
        };
        let endpoint = match Address::parse(address) {
            Address::Unix(path) => {
                if !path.exists() {
                    return Err(fail(format!(
                        "no socket at {} (is salusd running? start it with `salusd`, or set \
                         {ADDRESS_ENV})",
                        path.display()
                    )));
                }
                Endpoint::from_shared(format!("unix://{}", path.display()))
            }
            Address::Tcp(host) => Endpoint::from_shared(format!("http://{host}")),
            Address::Tls(host) => {
                let ca = tls_ca.ok_or_else(|| {
                    fail(format!(
                        "an https:// address needs {TLS_CA_ENV}: the CA certificate (PEM) that \
                         signed salusd's --tls-cert"
                    ))
                })?;
                let pem = std::fs::read(ca).map_err(|e| {
                    fail(format!("reading the CA certificate {}: {e}", ca.display()))
                })?;
                let tls = tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(pem));
                Endpoint::from_shared(format!("https://{host}"))
                    .and_then(|endpoint| endpoint.tls_config(tls))
            }
        }
        .map_err(|e| fail(e.to_string()))?;
        let channel = endpoint
            .initial_stream_window_size(salus_proto::wire::STREAM_WINDOW_BYTES)
            .initial_connection_window_size(salus_proto::wire::CONNECTION_WINDOW_BYTES)
            .connect()
            .await
            .map_err(|e| fail(format!("{e} ({})", source_chain(&e))))?;
        Ok(Client { channel, token })
    }

    /// The gRPC channel, for calling the generated stubs directly.
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// A request carrying this client's token, if any.
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let Some(token) = &self.token
            && let Ok(value) = salus_proto::wire::bearer(token).parse()
        {
            request
                .metadata_mut()
                .insert(salus_proto::wire::AUTHORIZATION, value);
        }
        request
    }

    fn sessions(&self) -> pb::sessions_client::SessionsClient<Channel> {
        pb::sessions_client::SessionsClient::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    fn admin(&self) -> pb::admin_client::AdminClient<Channel> {
        pb::admin_client::AdminClient::new(self.channel.clone())
    }

    /// Opens a session: sends the graph and initial values, and returns once the daemon
    /// has accepted it (queued or admitted). The session is held until closed or dropped.
    pub async fn open(&self, options: OpenOptions) -> Result<Session, Error> {
        let (tx, rx) = mpsc::channel::<pb::OpenRequest>(4);
        let item = |item| pb::OpenRequest { item: Some(item) };
        let updates = self
            .sessions()
            .open(self.request(ReceiverStream::new(rx)))
            .await?
            .into_inner();
        let send = |tx: mpsc::Sender<pb::OpenRequest>, message| async move {
            tx.send(message).await.is_ok()
        };
        let mut sent = send(
            tx.clone(),
            item(pb::open_request::Item::Open(pb::OpenSession {
                graph: Some(options.graph),
                kind: options.kind as i32,
                hints: Some(options.hints),
            })),
        )
        .await;
        for (tensor, bytes) in &options.initial {
            for chunk in chunks(*tensor, bytes) {
                sent = sent && send(tx.clone(), item(pb::open_request::Item::Chunk(chunk))).await;
            }
        }
        if sent {
            let _ = send(
                tx.clone(),
                item(pb::open_request::Item::Commit(pb::Commit {})),
            )
            .await;
        }
        self.lease(tx, updates).await
    }

    /// Takes back a session that salusd restored after a restart (`--state-dir`), with
    /// the token `opened` gave; the stream becomes its lease again.
    pub async fn reattach(&self, session: u64, token: Vec<u8>) -> Result<Session, Error> {
        let (tx, rx) = mpsc::channel::<pb::OpenRequest>(1);
        let updates = self
            .sessions()
            .open(self.request(ReceiverStream::new(rx)))
            .await?
            .into_inner();
        let _ = tx
            .send(pb::OpenRequest {
                item: Some(pb::open_request::Item::Reattach(pb::Reattach {
                    session,
                    token,
                })),
            })
            .await;
        self.lease(tx, updates).await
    }

    /// The session an `Open` stream's `opened` names; the stream is its lease.
    async fn lease(
        &self,
        tx: mpsc::Sender<pb::OpenRequest>,
        mut updates: tonic::Streaming<pb::SessionUpdate>,
    ) -> Result<Session, Error> {
        let opened = match updates.next().await {
            Some(Ok(pb::SessionUpdate {
                update: Some(pb::session_update::Update::Opened(opened)),
            })) => opened,
            Some(Ok(other)) => {
                return Err(Error::Protocol(format!("expected `opened`, got {other:?}")));
            }
            Some(Err(status)) => return Err(Error::Status(status)),
            None => {
                return Err(Error::Protocol(
                    "the daemon ended the session stream".into(),
                ));
            }
        };
        Ok(Session {
            id: opened.session,
            persistent_bytes: opened.persistent_bytes,
            ephemeral_bytes: opened.ephemeral_bytes,
            token: opened.token,
            iterations: opened.iterations,
            client: self.clone(),
            lease: Some(tx),
            updates,
            admitted: None,
        })
    }

    /// One request to a served model (any session of the caller's that `Serve` made
    /// one): its answer once its batch has run.
    pub async fn infer(&self, request: pb::InferRequest) -> Result<pb::InferResponse, Error> {
        Ok(self
            .sessions()
            .infer(self.request(request))
            .await?
            .into_inner())
    }

    /// The daemon's status.
    pub async fn status(&self) -> Result<pb::StatusResponse, Error> {
        Ok(self
            .admin()
            .status(self.request(pb::StatusRequest {}))
            .await?
            .into_inner())
    }

    /// Every open session with its statistics.
    pub async fn list_sessions(&self) -> Result<Vec<pb::SessionInfo>, Error> {
        Ok(self
            .admin()
            .list_sessions(self.request(pb::ListSessionsRequest {}))
            .await?
            .into_inner()
            .sessions)
    }

    /// Sets the policy (`Some`) or reads it (`None`); returns the policy now in force.
    pub async fn policy(&self, policy: Option<&str>) -> Result<String, Error> {
        Ok(self
            .admin()
            .set_policy(self.request(pb::SetPolicyRequest {
                policy: policy.unwrap_or_default().to_string(),
            }))
            .await?
            .into_inner()
            .policy)
    }

    /// Starts (`true`) or ends draining; returns whether the daemon drains now.
    pub async fn drain(&self, drain: bool) -> Result<bool, Error> {
        Ok(self
            .admin()
            .drain(self.request(pb::DrainRequest { drain }))
            .await?
            .into_inner()
            .draining)
    }

    /// Enables or disables offline sessions (`None` only reads); returns the protection's
    /// health state after the change.
    pub async fn offline(&self, enable: Option<bool>) -> Result<String, Error> {
        Ok(self
            .admin()
            .set_offline(self.request(pb::SetOfflineRequest { enable }))
            .await?
            .into_inner()
            .health)
    }

    /// Live events from now on.
    pub async fn watch(&self) -> Result<tonic::Streaming<pb::Event>, Error> {
        Ok(self
            .admin()
            .watch(self.request(pb::WatchRequest {}))
            .await?
            .into_inner())
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut parts = Vec::new();
    let mut next = e.source();
    while let Some(source) = next {
        parts.push(source.to_string());
        next = source.source();
    }
    parts.join(": ")
}

/// An open session. Dropping it ends the lease: the daemon closes it.
pub struct Session {
    /// The daemon's id for it.
    pub id: u64,
    /// P, in bytes.
    pub persistent_bytes: u64,
    /// E, in bytes.
    pub ephemeral_bytes: u64,
    /// The secret that reattaches it after a restart of salusd.
    pub token: Vec<u8>,
    /// Iterations it had done when `opened` came (0, or where a restored one resumes).
    pub iterations: u64,
    client: Client,
    lease: Option<mpsc::Sender<pb::OpenRequest>>,
    updates: tonic::Streaming<pb::SessionUpdate>,
    admitted: Option<pb::Admitted>,
}

impl Session {
    /// The next update about the session (queued, admitted, suspended); `None` once the
    /// daemon has closed it.
    pub async fn next_update(&mut self) -> Result<Option<pb::session_update::Update>, Error> {
        match self.updates.next().await {
            Some(Ok(update)) => {
                if let Some(pb::session_update::Update::Admitted(a)) = &update.update {
                    self.admitted = Some(*a);
                }
                Ok(update.update)
            }
            Some(Err(status)) => Err(Error::Status(status)),
            None => Ok(None),
        }
    }

    /// Waits until the session is admitted; returns its lane.
    pub async fn admitted(&mut self) -> Result<pb::Admitted, Error> {
        loop {
            if let Some(a) = self.admitted {
                return Ok(a);
            }
            if self.next_update().await?.is_none() {
                return Err(Error::Protocol(format!(
                    "session {} was closed before admission",
                    self.id
                )));
            }
        }
    }

    /// Runs one iteration: one byte buffer per feed, in graph order.
    pub async fn run(&self, feeds: Vec<Vec<u8>>) -> Result<pb::RunResponse, Error> {
        Ok(self
            .client
            .sessions()
            .run(self.client.request(pb::RunRequest {
                session: self.id,
                feeds,
                tag: 0,
                ..Default::default()
            }))
            .await?
            .into_inner())
    }

    /// Pipelined iterations: every request's response, in order.
    pub async fn run_stream(
        &self,
        requests: Vec<Vec<Vec<u8>>>,
    ) -> Result<tonic::Streaming<pb::RunResponse>, Error> {
        let id = self.id;
        let stream =
            tokio_stream::iter(requests.into_iter().enumerate().map(move |(tag, feeds)| {
                pb::RunRequest {
                    session: id,
                    feeds,
                    tag: tag as u64,
                    ..Default::default()
                }
            }));
        Ok(self
            .client
            .sessions()
            .run_stream(self.client.request(stream))
            .await?
            .into_inner())
    }

    /// Adds a program to the session: its step for other feed shapes (another batch
    /// size to serve). Returns its number and E.
    pub async fn add_program(&self, graph: pb::Graph) -> Result<pb::AddProgramResponse, Error> {
        Ok(self
            .client
            .sessions()
            .add_program(self.client.request(pb::AddProgramRequest {
                session: self.id,
                graph: Some(graph),
            }))
            .await?
            .into_inner())
    }

    /// Makes this inference session a served model (`request.session` is set to its
    /// id): salusd batches the requests [`Client::infer`] brings. Returns what salusd
    /// measured of each program.
    pub async fn serve(&self, mut request: pb::ServeRequest) -> Result<pb::ServeResponse, Error> {
        request.session = self.id;
        Ok(self
            .client
            .sessions()
            .serve(self.client.request(request))
            .await?
            .into_inner())
    }

    /// Reads persistent tensors (all PARAMETER and STATE tensors when `tensors` is empty).
    pub async fn read(&self, tensors: &[u32]) -> Result<Vec<(u32, Vec<u8>)>, Error> {
        let mut stream = self
            .client
            .sessions()
            .read_tensors(self.client.request(pb::ReadTensorsRequest {
                session: self.id,
                tensors: tensors.to_vec(),
            }))
            .await?
            .into_inner();
        let mut out: Vec<(u32, Vec<u8>)> = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk?;
            match out.last_mut() {
                Some((tensor, bytes)) if *tensor == chunk.tensor && chunk.offset > 0 => {
                    bytes.extend_from_slice(&chunk.data);
                }
                _ => out.push((chunk.tensor, chunk.data)),
            }
        }
        Ok(out)
    }

    /// Overwrites persistent tensors, all at once, between iterations.
    pub async fn write(&self, tensors: &[(u32, Vec<u8>)]) -> Result<u32, Error> {
        let mut messages = vec![pb::WriteTensorsRequest {
            item: Some(pb::write_tensors_request::Item::Session(self.id)),
        }];
        for (tensor, bytes) in tensors {
            messages.extend(
                chunks(*tensor, bytes)
                    .into_iter()
                    .map(|c| pb::WriteTensorsRequest {
                        item: Some(pb::write_tensors_request::Item::Chunk(c)),
                    }),
            );
        }
        Ok(self
            .client
            .sessions()
            .write_tensors(self.client.request(tokio_stream::iter(messages)))
            .await?
            .into_inner()
            .tensors_written)
    }

    /// Closes the session and waits until the daemon has let it go.
    pub async fn close(mut self) -> Result<(), Error> {
        self.client
            .sessions()
            .close(self.client.request(pb::CloseRequest { session: self.id }))
            .await?;
        self.lease = None;
        while self.next_update().await?.is_some() {}
        Ok(())
    }
}
