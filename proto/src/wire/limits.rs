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
        Request::Lookup(l) | Request::LookupLast(l) => return check_lookup(l),
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
}
