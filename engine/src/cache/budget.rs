//! The KV budget: bytes of KV cache that admitted sequences may reserve.
//!
//! A sequence reserves its worst case, (prompt + max_tokens) × bytes per token, when it is
//! admitted and releases it when it ends, so admission never over-commits memory however the
//! admitted sequences grow. Pure accounting: no MLX.

/// Bytes held by one admitted sequence; given back with [`KvBudget::release`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a reservation must be released"]
pub struct Reservation(u64);

impl Reservation {
    pub fn bytes(&self) -> u64 {
        self.0
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvBudget {
    /// `None`: unlimited.
    limit: Option<u64>,
    reserved: u64,
}

impl KvBudget {
    pub fn new(limit: Option<u64>) -> Self {
        Self { limit, reserved: 0 }
    }

    pub fn limit(&self) -> Option<u64> {
        self.limit
    }

    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// True when `bytes` fit beside what is reserved now.
    pub fn fits(&self, bytes: u64) -> bool {
        self.limit
            .is_none_or(|limit| self.reserved.saturating_add(bytes) <= limit)
    }

    /// True when `bytes` could fit once everything else is released.
    pub fn can_ever_fit(&self, bytes: u64) -> bool {
        self.limit.is_none_or(|limit| bytes <= limit)
    }

    pub fn reserve(&mut self, bytes: u64) -> Reservation {
        self.reserved = self.reserved.saturating_add(bytes);
        Reservation(bytes)
    }

    pub fn release(&mut self, reservation: Reservation) {
        self.reserved = self.reserved.saturating_sub(reservation.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserves_up_to_the_limit_and_releases() {
        let mut b = KvBudget::new(Some(100));
        assert!(b.fits(60));
        let r1 = b.reserve(60);
        assert!(b.fits(40));
        assert!(!b.fits(41));
        assert!(b.can_ever_fit(100));
        assert!(!b.can_ever_fit(101));
        b.release(r1);
        assert_eq!(b.reserved(), 0);
        assert!(b.fits(100));
    }

    #[test]
    fn unlimited_fits_anything() {
        let b = KvBudget::new(None);
        assert!(b.fits(u64::MAX));
        assert!(b.can_ever_fit(u64::MAX));
    }
}
