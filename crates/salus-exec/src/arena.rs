//! The device arena: one allocation of the device's capacity, handed out as disjoint
//! regions. Persistent blocks and lanes are offsets in it, as `salus-core` assigns them.
//!
//! Concurrent lanes write different parts of the same allocation at the same time, which
//! Rust's borrows cannot express for one `Vec`. So the arena keeps a registry of the regions
//! currently borrowed and refuses a borrow that overlaps one: two views of the same bytes
//! can never exist, whatever the scheduler says. That registry ([`Claims`]) is also what
//! the sim device, which keeps no bytes, accounts its memory with.

#![allow(unsafe_code)]

use std::ops::{Deref, DerefMut, Range};
use std::ptr::NonNull;
use std::sync::Mutex;

use crate::ExecError;

/// The byte ranges of a device's memory in use now, each claimed exclusively: a claim
/// outside the memory or overlapping a live one is refused.
pub(crate) struct Claims {
    len: usize,
    borrowed: Mutex<Vec<Range<usize>>>,
}

/// One claimed range, released when dropped.
pub(crate) struct Claim<'a> {
    claims: &'a Claims,
    range: Range<usize>,
}

impl Claims {
    /// A registry for `len` bytes, none claimed.
    pub(crate) fn new(len: usize) -> Claims {
        Claims {
            len,
            borrowed: Mutex::new(Vec::new()),
        }
    }

    /// Bytes of the memory.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Claims `[offset, offset + len)` until the claim is dropped.
    pub(crate) fn claim(&self, offset: u64, len: u64) -> Result<Claim<'_>, ExecError> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| start.checked_add(l))
            .filter(|&end| end <= self.len)
            .ok_or_else(|| {
                ExecError::Device(format!(
                    "bytes {offset}..{} are outside the arena of {} bytes",
                    offset.saturating_add(len),
                    self.len
                ))
            })?;
        let range = start..end;
        let mut borrowed = self
            .borrowed
            .lock()
            .map_err(|_| ExecError::Device("arena registry poisoned".into()))?;
        if let Some(other) = borrowed.iter().find(|r| {
            r.start < range.end && range.start < r.end && !range.is_empty() && !r.is_empty()
        }) {
            return Err(ExecError::Device(format!(
                "bytes {}..{} are in use by another lane or transfer ({}..{})",
                range.start, range.end, other.start, other.end
            )));
        }
        borrowed.push(range.clone());
        Ok(Claim {
            claims: self,
            range,
        })
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if let Ok(mut borrowed) = self.claims.borrowed.lock()
            && let Some(i) = borrowed.iter().position(|r| *r == self.range)
        {
            borrowed.swap_remove(i);
        }
    }
}

/// One allocation of `len` bytes, 16-byte aligned, zero-initialised.
pub struct Arena {
    base: NonNull<u8>,
    /// Keeps the allocation alive; only ever accessed through `base`.
    _storage: Box<[u128]>,
    claims: Claims,
}

// SAFETY: the arena owns its allocation, and every access goes through a `Region`, which
// the registry guarantees never overlaps another live `Region`.
unsafe impl Send for Arena {}
// SAFETY: as above; `&Arena` only hands out non-overlapping regions.
unsafe impl Sync for Arena {}

impl Arena {
    /// An arena of `len` bytes.
    pub fn new(len: u64) -> Result<Arena, ExecError> {
        let len = usize::try_from(len)
            .map_err(|_| ExecError::Device(format!("capacity {len} does not fit in memory")))?;
        let words = len.div_ceil(16);
        // Zeroed by the allocator (fresh pages from the kernel), not by writing: the arena's
        // memory is committed as sessions touch it, and a 4 GiB arena starts at once.
        let layout = std::alloc::Layout::array::<u128>(words.max(1))
            .map_err(|e| ExecError::Device(format!("cannot allocate {len} bytes: {e}")))?;
        // SAFETY: `layout` has a non-zero size (at least one word).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<u128>();
        if raw.is_null() {
            return Err(ExecError::Device(format!("cannot allocate {len} bytes")));
        }
        // SAFETY: `raw` was allocated by the global allocator with the layout of
        // `[u128; words.max(1)]`, is zero-initialised (a valid `u128` slice) and is owned
        // by nothing else; the box frees it with that same layout.
        let mut storage: Box<[u128]> =
            unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(raw, words.max(1))) };
        let base = NonNull::new(storage.as_mut_ptr().cast::<u8>())
            .ok_or_else(|| ExecError::Device("null allocation".into()))?;
        Ok(Arena {
            base,
            _storage: storage,
            claims: Claims::new(len),
        })
    }

    /// Capacity in bytes.
    pub fn len(&self) -> u64 {
        self.claims.len() as u64
    }

    /// True for a zero-byte arena.
    pub fn is_empty(&self) -> bool {
        self.claims.len() == 0
    }

    /// Exclusive access to `[offset, offset + len)`, until the region is dropped. Fails if
    /// the range is outside the arena or overlaps a region borrowed now.
    pub fn borrow(&self, offset: u64, len: u64) -> Result<Region<'_>, ExecError> {
        Ok(Region {
            arena: self,
            claim: self.claims.claim(offset, len)?,
        })
    }
}

/// Exclusive access to part of the arena.
pub struct Region<'a> {
    arena: &'a Arena,
    claim: Claim<'a>,
}

impl Deref for Region<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: the range is inside the allocation (checked in `borrow`) and no other
        // live region overlaps it (the registry), so no `&mut` to these bytes exists.
        unsafe {
            std::slice::from_raw_parts(
                self.arena.base.as_ptr().add(self.claim.range.start),
                self.claim.range.len(),
            )
        }
    }
}

impl DerefMut for Region<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only access through this
        // region.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.arena.base.as_ptr().add(self.claim.range.start),
                self.claim.range.len(),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_exclusive_and_released() {
        let arena = Arena::new(1024).unwrap();
        let mut a = arena.borrow(0, 256).unwrap();
        let b = arena.borrow(256, 256).unwrap();
        a[0] = 7;
        assert_eq!(b.len(), 256);
        let err = arena.borrow(128, 256).err().unwrap().to_string();
        assert!(err.contains("in use"), "{err}");
        drop(a);
        let again = arena.borrow(0, 256).unwrap();
        assert_eq!(again[0], 7);
        assert!(arena.borrow(1000, 100).is_err());
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&again[..16]).len(), 4);
    }

    #[test]
    fn concurrent_lanes_write_their_own_bytes() {
        let arena = Arena::new(4096).unwrap();
        std::thread::scope(|s| {
            for lane in 0..4u64 {
                let arena = &arena;
                s.spawn(move || {
                    let mut r = arena.borrow(lane * 1024, 1024).unwrap();
                    r.fill(lane as u8 + 1);
                });
            }
        });
        let all = arena.borrow(0, 4096).unwrap();
        for lane in 0..4 {
            assert!(
                all[lane * 1024..(lane + 1) * 1024]
                    .iter()
                    .all(|&b| b == lane as u8 + 1)
            );
        }
    }
}
