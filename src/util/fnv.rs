//! FNV-1a: a short, stable fingerprint of bytes (never a security hash), the same on every
//! host and run.

/// An FNV-1a hash fed piece by piece.
pub(crate) struct Fnv1a(u64);

impl Fnv1a {
    pub(crate) fn new() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }

    pub(crate) fn eat(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// The hash as 16 hex digits.
    pub(crate) fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}

/// The FNV-1a hash of `bytes` as 16 hex digits.
pub(crate) fn fnv1a(bytes: &[u8]) -> String {
    let mut h = Fnv1a::new();
    h.eat(bytes);
    h.hex()
}
