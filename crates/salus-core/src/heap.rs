//! The persistent region: a best-fit, coalescing heap growing up from offset 0.
//!
//! Persistent tensors (parameters, optimizer state, framework buffers) are placed once at
//! admission and freed at close, so a simple free list of holes below the heap top is all
//! that is needed; the heap top is where the region ends and the free gap toward the
//! lanes begins.

use std::collections::BTreeMap;

/// A placed persistent block, by offset and size, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    /// First byte of the block.
    pub offset: u64,
    /// Size of the block in bytes.
    pub size: u64,
}

/// The persistent heap: holes below `top`, kept coalesced.
#[derive(Debug, Clone, Default)]
pub struct PersistentHeap {
    /// Free holes below `top`, offset -> size. Never adjacent to each other nor to `top`.
    holes: BTreeMap<u64, u64>,
    /// End of the highest placed block.
    top: u64,
}

/// Where a new block of some size would go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Inside an existing hole at this offset (best fit).
    Hole(u64),
    /// At the current top; the heap grows by the block's size.
    Top(u64),
}

impl PersistentHeap {
    /// End of the persistent region: every byte at or above it is outside the heap.
    pub fn top(&self) -> u64 {
        self.top
    }

    /// Free holes below the top, in offset order.
    pub fn holes(&self) -> impl Iterator<Item = Block> + '_ {
        self.holes
            .iter()
            .map(|(&offset, &size)| Block { offset, size })
    }

    /// Best-fit placement for `size` bytes: the smallest hole that holds it (lowest offset
    /// on ties), else the top.
    pub fn place(&self, size: u64) -> Placement {
        self.holes
            .iter()
            .filter(|&(_, &hole)| hole >= size)
            .min_by_key(|&(&offset, &hole)| (hole, offset))
            .map(|(&offset, _)| Placement::Hole(offset))
            .unwrap_or(Placement::Top(self.top))
    }

    /// Heap top after placing `size` bytes at `placement`.
    pub fn top_after(&self, placement: Placement, size: u64) -> u64 {
        if size == 0 {
            return self.top;
        }
        match placement {
            Placement::Hole(_) => self.top,
            Placement::Top(o) => o.saturating_add(size),
        }
    }

    /// Takes `size` bytes at a placement returned by [`PersistentHeap::place`].
    pub fn allocate(&mut self, placement: Placement, size: u64) -> Block {
        if size == 0 {
            // Nothing to place; the empty block takes no room and leaves the holes alone.
            return Block {
                offset: self.top,
                size,
            };
        }
        match placement {
            Placement::Hole(offset) => {
                let hole = self.holes.remove(&offset).unwrap_or(0);
                debug_assert!(hole >= size, "placement no longer valid");
                if hole > size {
                    self.holes.insert(offset + size, hole - size);
                }
                Block { offset, size }
            }
            Placement::Top(offset) => {
                debug_assert_eq!(offset, self.top, "placement no longer valid");
                self.top = offset + size;
                Block { offset, size }
            }
        }
    }

    /// Returns a block, merging it with neighbouring holes and lowering the top when the
    /// block was the highest one.
    pub fn free(&mut self, block: Block) {
        if block.size == 0 {
            return;
        }
        let mut offset = block.offset;
        let mut size = block.size;
        if let Some((&prev, &prev_size)) = self.holes.range(..offset).next_back()
            && prev + prev_size == offset
        {
            self.holes.remove(&prev);
            offset = prev;
            size += prev_size;
        }
        if let Some(next_size) = self.holes.remove(&(offset + size)) {
            size += next_size;
        }
        if offset + size == self.top {
            self.top = offset;
        } else {
            self.holes.insert(offset, size);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(heap: &mut PersistentHeap, size: u64) -> Block {
        let p = heap.place(size);
        heap.allocate(p, size)
    }

    #[test]
    fn grows_up_from_zero() {
        let mut heap = PersistentHeap::default();
        let a = alloc(&mut heap, 100);
        let b = alloc(&mut heap, 50);
        assert_eq!((a.offset, b.offset, heap.top()), (0, 100, 150));
    }

    #[test]
    fn best_fit_picks_smallest_hole_that_fits() {
        let mut heap = PersistentHeap::default();
        let blocks: Vec<Block> = [100, 10, 40, 10, 60, 10]
            .iter()
            .map(|&s| alloc(&mut heap, s))
            .collect();
        heap.free(blocks[0]); // hole of 100 at 0
        heap.free(blocks[2]); // hole of 40 at 110
        heap.free(blocks[4]); // hole of 60 at 160
        assert_eq!(heap.place(30), Placement::Hole(110));
        assert_eq!(heap.place(50), Placement::Hole(160));
        assert_eq!(heap.place(100), Placement::Hole(0));
        assert_eq!(heap.place(101), Placement::Top(230));
    }

    #[test]
    fn freeing_coalesces_and_lowers_top() {
        let mut heap = PersistentHeap::default();
        let a = alloc(&mut heap, 10);
        let b = alloc(&mut heap, 20);
        let c = alloc(&mut heap, 30);
        heap.free(a);
        heap.free(b);
        assert_eq!(
            heap.holes().collect::<Vec<_>>(),
            vec![Block {
                offset: 0,
                size: 30
            }]
        );
        heap.free(c);
        assert_eq!(heap.top(), 0);
        assert_eq!(heap.holes().count(), 0);
    }

    #[test]
    fn freeing_top_block_absorbs_hole_below() {
        let mut heap = PersistentHeap::default();
        let a = alloc(&mut heap, 10);
        let b = alloc(&mut heap, 20);
        let c = alloc(&mut heap, 30);
        heap.free(b);
        heap.free(c);
        assert_eq!(heap.top(), 10);
        assert_eq!(heap.holes().count(), 0);
        heap.free(a);
        assert_eq!(heap.top(), 0);
    }

    #[test]
    fn split_hole_keeps_remainder() {
        let mut heap = PersistentHeap::default();
        let a = alloc(&mut heap, 100);
        let _b = alloc(&mut heap, 1);
        heap.free(a);
        let c = alloc(&mut heap, 30);
        assert_eq!(c.offset, 0);
        assert_eq!(
            heap.holes().collect::<Vec<_>>(),
            vec![Block {
                offset: 30,
                size: 70
            }]
        );
    }
}
