//! Who is asking, and what they may do.
//!
//! Over the Unix socket the kernel tells us the peer's uid (`SO_PEERCRED`); that user owns
//! the sessions it opens. Only the owner or root may run, read, write or close a session;
//! everyone sees every session in status, without its tensors. Changing the policy and
//! draining need root or the daemon's own user. Over TCP a client proves itself with the
//! bearer token from the daemon's token file and then acts as the daemon's user; a daemon
//! started with `--insecure-tcp` takes every TCP client as the unprivileged `nobody`.

use std::fmt;

use tonic::transport::server::{TcpConnectInfo, UdsConnectInfo};
use tonic::{Request, Status};

/// The uid TCP clients of an insecure daemon act as.
pub const NOBODY: u32 = 65534;

/// The user behind a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Principal {
    /// Unix user id.
    pub uid: u32,
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "uid {}", self.uid)
    }
}

impl Principal {
    /// True when this user may run, read, write or close a session owned by `owner`.
    pub fn may_use(self, owner: Principal) -> bool {
        self.uid == 0 || self.uid == owner.uid
    }

    /// True when this user may change the policy or drain.
    pub fn may_steer(self, daemon_uid: u32) -> bool {
        self.uid == 0 || self.uid == daemon_uid
    }
}

/// How requests are authenticated.
#[derive(Debug, Clone)]
pub struct Access {
    /// The daemon's own uid (TCP clients with the token act as it).
    pub daemon_uid: u32,
    /// The bearer token TCP clients must send; `None` with `insecure_tcp`.
    pub token: Option<String>,
    /// Accept TCP clients without a token (as `nobody`).
    pub insecure_tcp: bool,
}

impl Access {
    /// The principal of a request, or UNAUTHENTICATED.
    pub fn principal<T>(&self, request: &Request<T>) -> Result<Principal, Status> {
        if let Some(info) = request.extensions().get::<UdsConnectInfo>() {
            return info
                .peer_cred
                .map(|cred| Principal { uid: cred.uid() })
                .ok_or_else(|| {
                    Status::unauthenticated("the Unix socket gave no peer credentials")
                });
        }
        if request.extensions().get::<TcpConnectInfo>().is_some() || self.token.is_some() {
            let sent = request
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            return match (&self.token, sent) {
                (Some(token), Some(sent))
                    if constant_time_eq(token.as_bytes(), sent.as_bytes()) =>
                {
                    Ok(Principal {
                        uid: self.daemon_uid,
                    })
                }
                (Some(_), Some(_)) => Err(Status::unauthenticated("wrong bearer token")),
                (Some(_), None) => Err(Status::unauthenticated(
                    "TCP clients must send `authorization: Bearer <token>` (the daemon's token file; \
                     salusctl and salus-client read it from SALUS_TOKEN_FILE)",
                )),
                (None, _) if self.insecure_tcp => Ok(Principal { uid: NOBODY }),
                (None, _) => Err(Status::unauthenticated("this daemon takes no TCP clients")),
            };
        }
        Err(Status::unauthenticated("unknown transport"))
    }
}

/// Compares secrets without leaking where they differ through timing.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_and_root_use_sessions_others_do_not() {
        let owner = Principal { uid: 1000 };
        assert!(owner.may_use(owner));
        assert!(Principal { uid: 0 }.may_use(owner));
        assert!(!Principal { uid: 1001 }.may_use(owner));
    }

    #[test]
    fn steering_needs_root_or_the_daemon_user() {
        assert!(Principal { uid: 0 }.may_steer(999));
        assert!(Principal { uid: 999 }.may_steer(999));
        assert!(!Principal { uid: 1000 }.may_steer(999));
    }

    #[test]
    fn tokens_compare_exactly() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
    }
}
