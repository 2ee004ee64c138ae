//! The request limits both ends know: how many chunks one store, retrieve or lookup may name,
//! and how many shards one lookup may ask about. A client that keeps within them is never refused
//! for size; kvd checks them once, as a request arrives ([`check_limits`]), so that nothing past
//! its dispatch — the handlers, the disk and L2 fills — sees an oversized request.

use super::{Lookup, Request};

/// Most chunks in one store, retrieve or lookup.
pub const MAX_CHUNKS_PER_REQUEST: usize = 16_384;

/// Most shards in one lookup.
pub const MAX_SHARDS: usize = 1024;

/// Whether `req` keeps within the limits; the error says which it breaks.
pub fn check_limits(req: &Request) -> Result<(), String> {
    let chunks = match req {
        Request::Store(s) => s.chunks.len(),
        Request::Retrieve(r) => r.chunks.len(),
        Request::Lookup(l) => return check_lookup(l),
        Request::LookupLast(l) if l.held != 0 => {
            return Err("a LookupLast names no held chunks: send held 0".into())
        }
        Request::LookupLast(l) => return check_lookup(l),
        _ => return Ok(()),
    };
    if chunks > MAX_CHUNKS_PER_REQUEST {
        return Err(format!(
            "at most {MAX_CHUNKS_PER_REQUEST} chunks per request"
        ));
    }
    Ok(())
}

fn check_lookup(l: &Lookup) -> Result<(), String> {
    if l.hashes.len() > MAX_CHUNKS_PER_REQUEST || l.shards.len() > MAX_SHARDS {
        return Err(format!(
            "a lookup may name at most {MAX_CHUNKS_PER_REQUEST} chunks and {MAX_SHARDS} shards"
        ));
    }
    if l.held as usize > l.hashes.len() {
        return Err(format!(
            "a lookup's held ({}) must be at most its {} chunks: send the chunks the client \
             holds of those it names",
            l.held,
            l.hashes.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{ChunkBlocks, Ping, Store};

    fn lookup(hashes: usize, shards: usize) -> Request {
        Request::Lookup(Lookup {
            fingerprint: 1,
            salt: 0,
            shards: vec![0; shards],
            hashes: vec![0; hashes],
            pin: false,
            readers: 0,
            held: 0,
        })
    }

    fn store(chunks: usize) -> Request {
        let chunk = ChunkBlocks {
            hash: 0,
            blocks: Vec::new(),
        };
        Request::Store(Store {
            region: 0,
            salt: 0,
            chunks: vec![chunk; chunks],
            wait_slot: None,
            deadline_ns: 0,
        })
    }

    #[test]
    fn requests_over_a_limit_are_refused_and_those_at_it_are_not() {
        assert!(check_limits(&lookup(MAX_CHUNKS_PER_REQUEST, MAX_SHARDS)).is_ok());
        assert!(check_limits(&lookup(MAX_CHUNKS_PER_REQUEST + 1, 1)).is_err());
        assert!(check_limits(&lookup(1, MAX_SHARDS + 1)).is_err());
        assert!(check_limits(&store(MAX_CHUNKS_PER_REQUEST)).is_ok());
        assert!(check_limits(&store(MAX_CHUNKS_PER_REQUEST + 1)).is_err());
        assert!(check_limits(&Request::Ping(Ping {})).is_ok());
    }

    #[test]
    fn a_lookup_holding_more_chunks_than_it_names_is_refused() {
        let with_held = |held, last| {
            let Request::Lookup(mut l) = lookup(4, 1) else {
                unreachable!()
            };
            l.held = held;
            if last {
                Request::LookupLast(l)
            } else {
                Request::Lookup(l)
            }
        };
        assert!(check_limits(&with_held(4, false)).is_ok());
        let e = check_limits(&with_held(5, false)).unwrap_err();
        assert!(e.contains("held (5)") && e.contains("4 chunks"), "{e}");
        assert!(check_limits(&with_held(0, true)).is_ok());
        assert!(check_limits(&with_held(1, true))
            .unwrap_err()
            .contains("held 0"));
    }
}
