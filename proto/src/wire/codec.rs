//! The binary codec under the protocol: little-endian integers, length-prefixed strings and
//! lists, tagged enums. Decoding is bounded and never panics: every read is checked against the
//! bytes left, every list length against a ceiling and against what the remaining bytes could
//! hold, so a hostile length prefix cannot make kvd allocate.

use bytes::{BufMut, BytesMut};

/// Longest list any message may carry.
pub const MAX_LIST_LEN: usize = 1 << 20;
/// Longest string any message may carry, in bytes.
pub const MAX_STRING_BYTES: usize = 4096;

/// Why a frame could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The frame is larger than the server accepts.
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge {
        /// Frame length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The frame does not start with the protocol magic.
    #[error("frame does not start with the kvd magic \"KV\" (is this a kvd client?)")]
    BadMagic,
    /// The frame's protocol version is not this build's.
    #[error("frame speaks protocol version {got}; this build speaks {want}")]
    Version {
        /// Version in the frame.
        got: u8,
        /// Version of this build.
        want: u8,
    },
    /// Unknown message kind.
    #[error("unknown message kind {0:#04x}")]
    UnknownKind(u8),
    /// The frame ended early.
    #[error("frame truncated: needed {need} more bytes, {have} left")]
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes left.
        have: usize,
    },
    /// A list is longer than allowed.
    #[error("list of {len} items exceeds the limit of {max}")]
    ListTooLong {
        /// Declared length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A string is not UTF-8 or too long.
    #[error("bad string: {0}")]
    BadString(&'static str),
    /// An enum tag or boolean has no meaning.
    #[error("bad {what} tag {tag}")]
    BadTag {
        /// The enum.
        what: &'static str,
        /// The tag found.
        tag: u8,
    },
    /// Bytes remain after the message.
    #[error("{0} unexpected bytes after the message")]
    TrailingBytes(usize),
}

/// A cursor over a received frame.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// Starts reading `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// Bytes not yet read.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Takes the next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.remaining() < n {
            return Err(DecodeError::Truncated {
                need: n,
                have: self.remaining(),
            });
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    /// Takes a fixed-size array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    /// Fails unless every byte was read.
    pub fn finish(&self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(DecodeError::TrailingBytes(n)),
        }
    }

    /// Reads a list length and checks it against the limit and the bytes left.
    pub fn list_len(&mut self, min_item_bytes: usize) -> Result<usize, DecodeError> {
        let len = u32::decode(self)? as usize;
        if len > MAX_LIST_LEN {
            return Err(DecodeError::ListTooLong {
                len,
                max: MAX_LIST_LEN,
            });
        }
        let need = len.saturating_mul(min_item_bytes);
        if need > self.remaining() {
            return Err(DecodeError::Truncated {
                need,
                have: self.remaining(),
            });
        }
        Ok(len)
    }
}

/// A type with a wire form.
pub trait Wire: Sized {
    /// The fewest bytes an encoding can take; bounds list lengths before allocating.
    const MIN_BYTES: usize;
    /// Appends the encoding.
    fn encode(&self, out: &mut BytesMut);
    /// Reads one value.
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError>;
}

macro_rules! wire_int {
    ($($t:ty => $put:ident),*) => {$(
        impl Wire for $t {
            const MIN_BYTES: usize = std::mem::size_of::<$t>();
            fn encode(&self, out: &mut BytesMut) {
                out.$put(*self);
            }
            fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
                Ok(<$t>::from_le_bytes(r.array()?))
            }
        }
    )*};
}
wire_int!(u8 => put_u8, u16 => put_u16_le, u32 => put_u32_le, u64 => put_u64_le, u128 => put_u128_le);

impl Wire for bool {
    const MIN_BYTES: usize = 1;
    fn encode(&self, out: &mut BytesMut) {
        out.put_u8(u8::from(*self));
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match u8::decode(r)? {
            0 => Ok(false),
            1 => Ok(true),
            tag => Err(DecodeError::BadTag { what: "bool", tag }),
        }
    }
}

impl Wire for String {
    const MIN_BYTES: usize = 2;
    fn encode(&self, out: &mut BytesMut) {
        // Longer strings are cut at a character boundary so that encoding never fails.
        let mut end = self.len().min(MAX_STRING_BYTES);
        while !self.is_char_boundary(end) {
            end -= 1;
        }
        out.put_u16_le(end as u16);
        out.put_slice(&self.as_bytes()[..end]);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let len = u16::decode(r)? as usize;
        if len > MAX_STRING_BYTES {
            return Err(DecodeError::BadString("longer than 4096 bytes"));
        }
        let bytes = r.take(len)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| DecodeError::BadString("not UTF-8"))
    }
}

impl<T: Wire> Wire for Vec<T> {
    const MIN_BYTES: usize = 4;
    fn encode(&self, out: &mut BytesMut) {
        out.put_u32_le(self.len() as u32);
        for item in self {
            item.encode(out);
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let len = r.list_len(T::MIN_BYTES.max(1))?;
        let mut out = Vec::with_capacity(len);
        for _ in 0..len {
            out.push(T::decode(r)?);
        }
        Ok(out)
    }
}

impl<T: Wire> Wire for Option<T> {
    const MIN_BYTES: usize = 1;
    fn encode(&self, out: &mut BytesMut) {
        match self {
            None => out.put_u8(0),
            Some(v) => {
                out.put_u8(1);
                v.encode(out);
            }
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match u8::decode(r)? {
            0 => Ok(None),
            1 => Ok(Some(T::decode(r)?)),
            tag => Err(DecodeError::BadTag {
                what: "option",
                tag,
            }),
        }
    }
}

impl<const N: usize> Wire for [u8; N] {
    const MIN_BYTES: usize = N;
    fn encode(&self, out: &mut BytesMut) {
        out.put_slice(self);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        r.array()
    }
}

/// Declares a struct whose wire form is its fields in order.
macro_rules! wire_struct {
    ($(#[$meta:meta])* pub struct $name:ident { $($(#[$fmeta:meta])* pub $field:ident : $ty:ty),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq)]
        #[cfg_attr(test, derive(proptest_derive::Arbitrary))]
        pub struct $name { $($(#[$fmeta])* pub $field: $ty),* }

        impl $crate::wire::codec::Wire for $name {
            const MIN_BYTES: usize = 0 $(+ <$ty as $crate::wire::codec::Wire>::MIN_BYTES)*;
            #[allow(unused_variables)]
            fn encode(&self, out: &mut bytes::BytesMut) {
                $($crate::wire::codec::Wire::encode(&self.$field, out);)*
            }
            #[allow(unused_variables)]
            fn decode(
                r: &mut $crate::wire::codec::Reader<'_>,
            ) -> Result<Self, $crate::wire::codec::DecodeError> {
                Ok(Self { $($field: $crate::wire::codec::Wire::decode(r)?),* })
            }
        }
    };
}

/// Declares a fieldless enum carried as one byte.
macro_rules! wire_enum {
    ($(#[$meta:meta])* pub enum $name:ident { $($(#[$vmeta:meta])* $variant:ident = $tag:literal),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[cfg_attr(test, derive(proptest_derive::Arbitrary))]
        #[repr(u8)]
        pub enum $name { $($(#[$vmeta])* $variant = $tag),* }

        impl $crate::wire::codec::Wire for $name {
            const MIN_BYTES: usize = 1;
            fn encode(&self, out: &mut bytes::BytesMut) {
                bytes::BufMut::put_u8(out, *self as u8);
            }
            fn decode(
                r: &mut $crate::wire::codec::Reader<'_>,
            ) -> Result<Self, $crate::wire::codec::DecodeError> {
                match <u8 as $crate::wire::codec::Wire>::decode(r)? {
                    $($tag => Ok($name::$variant),)*
                    tag => Err($crate::wire::codec::DecodeError::BadTag { what: stringify!($name), tag }),
                }
            }
        }
    };
}

pub(crate) use wire_enum;
pub(crate) use wire_struct;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_list_length_is_refused_without_allocating() {
        let mut out = BytesMut::new();
        out.put_u32_le(u32::MAX);
        let err = Vec::<u64>::decode(&mut Reader::new(&out)).unwrap_err();
        assert!(matches!(err, DecodeError::ListTooLong { .. }), "{err}");
        let mut out = BytesMut::new();
        out.put_u32_le(1000);
        out.put_u64_le(1);
        let err = Vec::<u64>::decode(&mut Reader::new(&out)).unwrap_err();
        assert!(
            matches!(err, DecodeError::Truncated { need: 8000, .. }),
            "{err}"
        );
    }

    #[test]
    fn strings_are_checked() {
        let mut out = BytesMut::new();
        out.put_u16_le(2);
        out.put_slice(&[0xff, 0xfe]);
        assert_eq!(
            String::decode(&mut Reader::new(&out)),
            Err(DecodeError::BadString("not UTF-8"))
        );
        let long = "é".repeat(3000);
        let mut out = BytesMut::new();
        long.encode(&mut out);
        let back = String::decode(&mut Reader::new(&out)).unwrap();
        assert!(back.len() <= MAX_STRING_BYTES && long.starts_with(&back));
    }

    #[test]
    fn bad_bool_and_option_tags() {
        assert!(bool::decode(&mut Reader::new(&[2])).is_err());
        assert!(Option::<u8>::decode(&mut Reader::new(&[9, 0])).is_err());
        assert_eq!(Option::<u8>::decode(&mut Reader::new(&[1, 5])), Ok(Some(5)));
    }
}
