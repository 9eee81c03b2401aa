//! Who is asking, and what they may do.
//!
//! Over the Unix socket the kernel tells us the peer's uid (`SO_PEERCRED`); that user owns
//! the sessions it opens. Only the owner or root may run, read, write or close a session;
//! everyone sees every session in status, without its tensors. Changing the policy and
//! draining need root or the daemon's own user. Over TCP a client proves itself with the
//! bearer token from the daemon's token file and then acts as the daemon's user; a daemon
//! started with `--insecure-tcp` takes every TCP client as the unprivileged `nobody`.
//!
//! Every permission rule lives here: [`Principal::check_session`] and
//! [`Principal::check_steering`] are the only checks the engine makes, and [`Denied`]
//! says who was refused what.

use std::fmt;

use salus_proto::wire::{self, Peer};
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

/// What only root and the daemon's own user may do to the whole daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Steering {
    /// Change the policy.
    Policy,
    /// Start or stop draining.
    Drain,
    /// Enable or disable offline sessions.
    Offline,
}

impl fmt::Display for Steering {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Steering::Policy => "changing the policy",
            Steering::Drain => "draining",
            Steering::Offline => "enabling or disabling offline sessions",
        })
    }
}

/// A request refused because of who made it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    /// A session used by someone other than its owner or root.
    #[error("session {session} belongs to uid {}; {principal} may not use it", .owner.uid)]
    Session {
        /// Which session.
        session: u64,
        /// Who owns it.
        owner: Principal,
        /// Who asked.
        principal: Principal,
    },
    /// The daemon steered by someone other than root or its own user.
    #[error("{what} needs root or the daemon's user (uid {daemon_uid}); {principal} may not")]
    Steering {
        /// What was asked.
        what: Steering,
        /// The daemon's own uid.
        daemon_uid: u32,
        /// Who asked.
        principal: Principal,
    },
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

    /// May this user run, read, write or close `session`, owned by `owner`?
    pub fn check_session(self, session: u64, owner: Principal) -> Result<(), Denied> {
        if self.may_use(owner) {
            Ok(())
        } else {
            Err(Denied::Session {
                session,
                owner,
                principal: self,
            })
        }
    }

    /// May this user do `what` to a daemon running as `daemon_uid`?
    pub fn check_steering(self, what: Steering, daemon_uid: u32) -> Result<(), Denied> {
        if self.may_steer(daemon_uid) {
            Ok(())
        } else {
            Err(Denied::Steering {
                what,
                daemon_uid,
                principal: self,
            })
        }
    }
}

/// How requests are authenticated.
#[derive(Debug, Clone)]
pub struct Access {
    /// The daemon's own uid (TCP clients with the token act as it).
    pub daemon_uid: u32,
    /// The bearer token TCP clients must send; `None` with `insecure_tcp`. Never empty:
    /// salusd refuses to start with a short token (`config::read_token`).
    pub token: Option<String>,
    /// Accept TCP clients without a token (as `nobody`).
    pub insecure_tcp: bool,
}

impl Access {
    /// The principal of a request, or UNAUTHENTICATED.
    pub fn principal<T>(&self, request: &Request<T>) -> Result<Principal, Status> {
        let peer = wire::peer(request);
        if let Peer::Unix { uid } = peer {
            return uid.map(|uid| Principal { uid }).ok_or_else(|| {
                Status::unauthenticated("the Unix socket gave no peer credentials")
            });
        }
        if peer == Peer::Tcp || self.token.is_some() {
            return match (&self.token, wire::bearer_token(request)) {
                (Some(token), Some(sent))
                    if !token.is_empty() && constant_time_eq(token.as_bytes(), sent.as_bytes()) =>
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

/// Compares the secret with what a client sent without leaking, through timing, where
/// they differ or how long the secret is: the work depends only on the length of `sent`.
fn constant_time_eq(secret: &[u8], sent: &[u8]) -> bool {
    if secret.is_empty() {
        return false;
    }
    let mut differ = u8::from(secret.len() != sent.len());
    for (i, byte) in sent.iter().enumerate() {
        differ |= byte ^ secret[i % secret.len()];
    }
    differ == 0
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
    fn refusals_say_who_was_refused_what() {
        let owner = Principal { uid: 1000 };
        let other = Principal { uid: 1001 };
        assert_eq!(
            other.check_session(7, owner).map_err(|e| e.to_string()),
            Err("session 7 belongs to uid 1000; uid 1001 may not use it".into())
        );
        assert_eq!(
            other
                .check_steering(Steering::Policy, 999)
                .map_err(|e| e.to_string()),
            Err(
                "changing the policy needs root or the daemon's user (uid 999); uid 1001 may not"
                    .into()
            )
        );
        assert_eq!(
            other
                .check_steering(Steering::Drain, 999)
                .map_err(|e| e.to_string()),
            Err("draining needs root or the daemon's user (uid 999); uid 1001 may not".into())
        );
        assert!(owner.check_session(7, owner).is_ok());
        assert!(
            Principal { uid: 999 }
                .check_steering(Steering::Drain, 999)
                .is_ok()
        );
    }

    #[test]
    fn tokens_compare_exactly() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(
            !constant_time_eq(b"secret", b"secretsecret"),
            "a repeat is not the secret"
        );
        assert!(!constant_time_eq(b"secret", b""));
        assert!(
            !constant_time_eq(b"", b""),
            "an empty secret lets nobody in"
        );
    }
}
