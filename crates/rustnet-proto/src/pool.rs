//! A fixed pool of requests with generation-checked ids: no allocation after
//! creation, and a stale or doubled id is an error, never a wrong answer.

/// Names one live request of one pool: slot index plus generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReqId {
    /// Slot index (< capacity, at most 256).
    pub slot: u8,
    /// Generation of the slot when the id was handed out.
    pub gen: u8,
}

struct Slot<T> {
    gen: u8,
    val: Option<T>,
}

/// Fixed-capacity request storage.
pub struct Pool<T> {
    slots: Box<[Slot<T>]>,
    free: Vec<u8>,
}

/// Why an id was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stale {
    /// Slot index beyond the pool.
    OutOfRange,
    /// The slot holds nothing: the request was already completed and freed.
    Freed,
    /// The slot was reused by a newer request.
    Reused,
}

impl std::fmt::Display for Stale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stale::OutOfRange => "request id out of range",
            Stale::Freed => "request already completed (tested again after done=1?)",
            Stale::Reused => "stale request id (its slot now belongs to a newer request)",
        })
    }
}

impl<T> Pool<T> {
    /// A pool of `cap` slots (1..=256).
    pub fn new(cap: usize) -> Self {
        assert!((1..=256).contains(&cap), "pool capacity {cap} out of 1..=256");
        let slots = (0..cap).map(|_| Slot { gen: 0, val: None }).collect::<Vec<_>>().into_boxed_slice();
        // Hand out low slots first (pop from the end).
        let free = (0..cap).rev().map(|i| i as u8).collect();
        Pool { slots, free }
    }

    /// Capacity.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Live requests.
    pub fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// True when no request is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Store `val`; `None` when all slots are busy (NCCL then retries).
    pub fn alloc(&mut self, val: T) -> Option<ReqId> {
        let slot = self.free.pop()?;
        let s = &mut self.slots[slot as usize];
        debug_assert!(s.val.is_none());
        s.val = Some(val);
        Some(ReqId { slot, gen: s.gen })
    }

    /// Why `id` names no live request (the caller found it does not).
    #[cold]
    #[inline(never)]
    fn stale(&self, id: ReqId) -> Stale {
        match self.slots.get(id.slot as usize) {
            None => Stale::OutOfRange,
            Some(s) if s.gen != id.gen => Stale::Reused,
            Some(_) => Stale::Freed,
        }
    }

    /// Does `id` name a live request? (Every `test` asks: one bounds check,
    /// one compare; the reasons it does not are built out of line.)
    #[inline]
    fn live(&self, id: ReqId) -> bool {
        matches!(self.slots.get(id.slot as usize), Some(Slot { gen, val: Some(_) }) if *gen == id.gen)
    }

    /// The request behind `id`.
    #[inline]
    pub fn get(&self, id: ReqId) -> Result<&T, Stale> {
        match self.slots.get(id.slot as usize) {
            Some(Slot { gen, val: Some(v) }) if *gen == id.gen => Ok(v),
            _ => Err(self.stale(id)),
        }
    }

    /// The request behind `id`, mutably.
    #[inline]
    pub fn get_mut(&mut self, id: ReqId) -> Result<&mut T, Stale> {
        if !self.live(id) {
            return Err(self.stale(id));
        }
        match &mut self.slots[id.slot as usize].val {
            Some(v) => Ok(v),
            None => Err(Stale::Freed), // (checked just above)
        }
    }

    /// Free `id` and return its value; the slot's generation moves on.
    pub fn release(&mut self, id: ReqId) -> Result<T, Stale> {
        if !self.live(id) {
            return Err(self.stale(id));
        }
        let s = &mut self.slots[id.slot as usize];
        let Some(v) = s.val.take() else { return Err(Stale::Freed) }; // (checked just above)
        s.gen = s.gen.wrapping_add(1);
        self.free.push(id.slot);
        Ok(v)
    }

    /// Every live request.
    pub fn iter(&self) -> impl Iterator<Item = (ReqId, &T)> {
        self.slots.iter().enumerate().filter_map(|(i, s)| s.val.as_ref().map(|v| (ReqId { slot: i as u8, gen: s.gen }, v)))
    }

    /// Every live request, for failing them all at once.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (ReqId, &mut T)> {
        self.slots.iter_mut().enumerate().filter_map(|(i, s)| {
            let gen = s.gen;
            s.val.as_mut().map(|v| (ReqId { slot: i as u8, gen }, v))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exhaustion_returns_none_and_release_makes_room() {
        let mut p = Pool::new(4);
        let ids: Vec<_> = (0..4).map(|i| p.alloc(i).unwrap()).collect();
        assert!(p.alloc(99).is_none());
        assert_eq!(p.release(ids[2]).unwrap(), 2);
        let again = p.alloc(7).unwrap();
        assert_eq!(again.slot, ids[2].slot);
        assert_ne!(again.gen, ids[2].gen);
    }

    #[test]
    fn stale_and_double_use_detected() {
        let mut p = Pool::new(2);
        let a = p.alloc("a").unwrap();
        p.release(a).unwrap();
        assert_eq!(p.get(a).unwrap_err(), Stale::Reused);
        let b = p.alloc("b").unwrap();
        assert_eq!(b.slot, a.slot);
        assert_eq!(p.release(a).unwrap_err(), Stale::Reused);
        assert_eq!(*p.get(b).unwrap(), "b");
        assert_eq!(p.get(ReqId { slot: 9, gen: 0 }).unwrap_err(), Stale::OutOfRange);
        let c = ReqId { slot: 1, gen: 0 };
        assert_eq!(p.get(c).unwrap_err(), Stale::Freed);
    }

    #[test]
    fn many_cycles_keep_capacity() {
        let mut p = Pool::new(256);
        for round in 0..1000u32 {
            let ids: Vec<_> = (0..256).map(|i| p.alloc(i + round).unwrap()).collect();
            assert!(p.alloc(0).is_none());
            for id in ids {
                p.release(id).unwrap();
            }
            assert!(p.is_empty());
        }
    }
}
