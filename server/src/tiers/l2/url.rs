//! `--l2` URLs taken apart: the scheme (TLS, cluster), the credentials (%-decoded), and the
//! hosts and database as written.

use super::secret::Secret;
use crate::config::ConfigError;

const USAGE: &str = "use redis://HOST:PORT, rediss://HOST:PORT (TLS) or \
                     redis+cluster://H1:P1,H2:P2 (a cluster)";

/// Decodes `%XX` escapes, as in a URL's user information.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

pub(super) fn check_host_port(shown: &str, hp: &str) -> Result<String, ConfigError> {
    let bad = || ConfigError(format!("--l2 {shown}: {hp:?} is not HOST:PORT; {USAGE}"));
    let (host, port) = hp.rsplit_once(':').ok_or_else(bad)?;
    if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
        return Err(bad());
    }
    Ok(hp.to_string())
}

/// A URL taken apart: scheme flags, credentials, and the rest.
pub(super) struct ParsedUrl {
    pub(super) tls: bool,
    pub(super) cluster: bool,
    pub(super) username: Option<String>,
    pub(super) password: Option<Secret>,
    /// Host list and database, as written.
    pub(super) rest: String,
    pub(super) scheme: &'static str,
}

pub(super) fn parse_url(url: &str) -> Result<ParsedUrl, ConfigError> {
    let schemes = [
        ("rediss+cluster://", true, true),
        ("redis+cluster://", false, true),
        ("rediss://", true, false),
        ("redis://", false, false),
    ];
    let Some((scheme, tls, cluster, rest)) = schemes
        .iter()
        .find_map(|&(s, tls, cl)| url.strip_prefix(s).map(|r| (s, tls, cl, r)))
    else {
        let shown = url.split_once('@').map_or(url, |(_, r)| r);
        return Err(ConfigError(format!(
            "--l2 {shown}: unknown scheme; {USAGE} (Valkey or Redis)"
        )));
    };
    // Host names have no '@'; a password may, so the last one ends the user information.
    let (userinfo, rest) = match rest.rsplit_once('@') {
        Some((u, r)) => (Some(u), r),
        None => (None, rest),
    };
    let (username, password) = match userinfo {
        None => (None, None),
        Some(u) => {
            let (user, pass) = match u.split_once(':') {
                Some((user, pass)) => (user, Some(pass)),
                None => (u, None),
            };
            let bad = || {
                ConfigError(format!(
                    "--l2 {scheme}…@{rest}: the user or password has a bad %-escape; write it as in a URL"
                ))
            };
            let user = percent_decode(user).ok_or_else(bad)?;
            let pass = match pass {
                Some(p) => Some(percent_decode(p).ok_or_else(bad)?),
                None => None,
            };
            (
                (!user.is_empty()).then_some(user),
                pass.filter(|p| !p.is_empty()).map(Secret::new),
            )
        }
    };
    Ok(ParsedUrl {
        tls,
        cluster,
        username,
        password,
        rest: rest.to_string(),
        scheme: &scheme[..scheme.len() - 3],
    })
}
