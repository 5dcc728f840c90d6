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

/// A GPU's memory as its driver reports it once the weights are loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    pub free: u64,
    pub total: u64,
}

/// Device memory kept out of the KV budget: the activations of the largest pass, MLX's cache
/// of freed buffers and the CUDA context's own allocations. A tenth of the device (as vLLM's
/// default `gpu_memory_utilization` of 0.9 keeps), at least 2 GiB.
pub fn device_headroom(total: u64) -> u64 {
    (total / 10).max(2 << 30)
}

/// Where an engine's KV budget comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetSource {
    /// The configured budget, which fits.
    Configured,
    /// No budget was configured: the device's free memory less the headroom.
    Device,
    /// The configured budget (`configured` bytes) is more than the device can hold: it is
    /// cut to the free memory less the headroom.
    Clamped { configured: u64 },
}

/// The KV budget an engine runs with on a device whose free memory it can read: the
/// configured one while it fits in `memory.free` less [`device_headroom`], else that room.
/// Without a budget the KV cache would grow until an allocation fails mid-step (on CUDA, after
/// the driver has pushed managed buffers out to host memory, a slow crawl before the error).
/// An error when the device has no room left for any KV cache.
pub fn kv_budget_within(
    configured: Option<u64>,
    memory: DeviceMemory,
) -> Result<(u64, BudgetSource), String> {
    let headroom = device_headroom(memory.total);
    let room = memory.free.saturating_sub(headroom);
    if room == 0 {
        return Err(format!(
            "the GPU has {} MiB free once the weights are loaded, within the {} MiB kept for \
             activations: no room is left for a KV cache (free GPU memory, or serve a smaller \
             model)",
            memory.free >> 20,
            headroom >> 20
        ));
    }
    Ok(match configured {
        None => (room, BudgetSource::Device),
        Some(bytes) if bytes <= room => (bytes, BudgetSource::Configured),
        Some(bytes) => (room, BudgetSource::Clamped { configured: bytes }),
    })
}

/// The longest context a KV budget holds for one sequence of `per_token` bytes a position and
/// `state` bytes whatever its length, at most `context`; an error when it holds no position.
pub fn context_held(
    budget: u64,
    per_token: u64,
    state: u64,
    context: usize,
) -> Result<usize, String> {
    let holds = budget.saturating_sub(state) / per_token.max(1);
    if holds == 0 {
        return Err(format!(
            "a KV budget of {} MiB holds not one position of this model's cache",
            budget >> 20
        ));
    }
    Ok((context as u64).min(holds) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn the_headroom_is_a_tenth_of_the_device_and_at_least_2_gib() {
        assert_eq!(device_headroom(80 * GIB), 8 * GIB);
        assert_eq!(device_headroom(8 * GIB), 2 * GIB);
    }

    #[test]
    fn a_budget_that_fits_is_kept_and_a_larger_one_cut_to_the_room() {
        let memory = DeviceMemory {
            free: 60 * GIB,
            total: 80 * GIB,
        };
        // 60 free less 8 of headroom: 52 GiB of room.
        assert_eq!(
            kv_budget_within(Some(10 * GIB), memory),
            Ok((10 * GIB, BudgetSource::Configured))
        );
        assert_eq!(
            kv_budget_within(Some(52 * GIB), memory),
            Ok((52 * GIB, BudgetSource::Configured))
        );
        assert_eq!(
            kv_budget_within(Some(200 * GIB), memory),
            Ok((
                52 * GIB,
                BudgetSource::Clamped {
                    configured: 200 * GIB
                }
            ))
        );
        assert_eq!(
            kv_budget_within(None, memory),
            Ok((52 * GIB, BudgetSource::Device))
        );
    }

    #[test]
    fn the_context_is_cut_to_what_the_budget_holds() {
        // 1 MiB at 256 bytes a position: 4096 positions, less the state's 64 KiB: 3840.
        assert_eq!(context_held(1 << 20, 256, 0, 512), Ok(512));
        assert_eq!(context_held(1 << 20, 256, 0, 8192), Ok(4096));
        assert_eq!(context_held(1 << 20, 256, 64 << 10, 8192), Ok(3840));
        assert!(context_held(100, 256, 0, 8192).is_err());
        assert!(context_held(1 << 20, 256, 2 << 20, 8192).is_err());
    }

    #[test]
    fn no_room_left_after_the_weights_is_an_error_naming_the_figures() {
        let memory = DeviceMemory {
            free: 7 * GIB,
            total: 80 * GIB,
        };
        let e = kv_budget_within(None, memory).unwrap_err();
        assert!(e.contains("7168 MiB free") && e.contains("8192 MiB"), "{e}");
    }

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
