//! Connections refused before they became clients: bytes on the control port that are not ZMTP
//! (an HTTP scraper or a TLS client pointed at the wrong port, a port scanner), a ZMTP peer
//! kvd cannot talk to, a handshake never finished. Each is counted by reason in
//! `kvd_connections_closed_total`, and an info line names the peer and what was wrong — at most
//! one a minute, saying how many were not logged since, so that a scraper retrying every second
//! cannot flood the log. A peer that connects and closes without a word is neither counted nor
//! logged: TCP health checks of the port do that.

use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::zmtp::ZmtpError;

/// Most one info line per this long.
pub const LOG_EVERY: Duration = Duration::from_secs(60);

/// The `reason` label of `kvd_connections_closed_total` for a handshake that failed with `e`;
/// `None` where the peer merely went away.
pub fn reason_of(e: &ZmtpError) -> Option<&'static str> {
    match e {
        ZmtpError::NotZmtp(_) => Some("not_zmtp"),
        ZmtpError::Protocol(_) => Some("bad_handshake"),
        ZmtpError::HandshakeTimeout(_) => Some("handshake_timeout"),
        ZmtpError::Closed | ZmtpError::Io { .. } | ZmtpError::Endpoint(_) => None,
    }
}

/// What the peer probably is, for bytes that are not ZMTP, with its leading separator.
fn guess(e: &ZmtpError) -> &'static str {
    let ZmtpError::NotZmtp(head) = e else {
        return "";
    };
    const HTTP: [&[u8]; 6] = [b"GET ", b"POST ", b"HEAD ", b"PUT ", b"OPTIONS ", b"PRI * "];
    if HTTP.iter().any(|m| head.starts_with(m)) {
        "; an HTTP client: kvd serves /healthz and /metrics on --http-port"
    } else if head.first() == Some(&0x16) {
        "; a TLS client: kvd's ZMQ port speaks plain ZMTP (a DEALER socket)"
    } else {
        ""
    }
}

/// Rate-limits the info line about refused connections.
#[derive(Debug, Default)]
pub struct RefusalLog {
    /// When the last line was logged, and how many refusals were not logged since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl RefusalLog {
    /// Whether a refusal at `now` gets a line: `Some(n)` with the `n` refusals not logged
    /// since the last one, `None` within [`LOG_EVERY`] of it.
    pub fn take_turn(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.lock();
        match s.0 {
            Some(last) if now < last + LOG_EVERY => {
                s.1 += 1;
                None
            }
            _ => {
                s.0 = Some(now);
                Some(std::mem::take(&mut s.1))
            }
        }
    }

    /// Logs a refused connection from `peer` (for reason `reason`), if it is this one's turn.
    pub fn refused(&self, peer: &str, reason: &str, e: &ZmtpError) {
        match self.take_turn(Instant::now()) {
            Some(quiet) => tracing::info!(
                "refused a ZMQ connection from {peer}: {e}{}{}; more in the next {} s are counted \
                 in kvd_connections_closed_total{{reason=\"{reason}\"}}, not logged",
                guess(e),
                if quiet > 0 {
                    format!(" ({quiet} more refused since the last such line)")
                } else {
                    String::new()
                },
                LOG_EVERY.as_secs()
            ),
            None => tracing::debug!("refused a ZMQ connection from {peer}: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_a_minute_with_the_count_of_those_not_logged() {
        let log = RefusalLog::default();
        let t0 = Instant::now();
        assert_eq!(log.take_turn(t0), Some(0), "the first one is logged");
        for s in 1..60 {
            assert_eq!(log.take_turn(t0 + Duration::from_secs(s)), None);
        }
        assert_eq!(log.take_turn(t0 + LOG_EVERY), Some(59));
        assert_eq!(log.take_turn(t0 + LOG_EVERY * 3), Some(0));
    }

    #[test]
    fn reasons_and_guesses() {
        let http = ZmtpError::NotZmtp(b"GET / HTTP/".to_vec());
        assert_eq!(reason_of(&http), Some("not_zmtp"));
        assert!(guess(&http).contains("--http-port"));
        assert!(guess(&ZmtpError::NotZmtp(vec![0x16, 3, 1])).contains("TLS"));
        assert_eq!(guess(&ZmtpError::NotZmtp(b"hello there".to_vec())), "");
        assert_eq!(
            reason_of(&ZmtpError::Protocol("expected READY".into())),
            Some("bad_handshake")
        );
        assert_eq!(
            reason_of(&ZmtpError::HandshakeTimeout(Duration::from_secs(5))),
            Some("handshake_timeout")
        );
        assert_eq!(reason_of(&ZmtpError::Closed), None, "a port check");
    }
}
