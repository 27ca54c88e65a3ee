//! One shared copy of a value many pods carry alike: a Deployment's replicas share their labels and their
//! namespace's name; every pod on a node names the same node, every pod of a budget the
//! same budget. At 150 000 pods a copy each is most of what the operator holds (docs/performance.md).

use std::collections::HashSet;
use std::hash::Hash;
use std::sync::Arc;

/// Values kept once. Values no pod holds any more are dropped whenever the number kept has doubled, so the
/// pool stays bounded by what is in use.
#[derive(Debug)]
pub struct Pool<T: ?Sized> {
    kept: HashSet<Arc<T>>,
    /// How many were kept after the last sweep.
    swept: usize,
}

impl<T: ?Sized> Default for Pool<T> {
    fn default() -> Self {
        Self { kept: HashSet::new(), swept: 0 }
    }
}

impl<T: ?Sized + Eq + Hash> Pool<T> {
    /// Fewer kept than this are never swept.
    const SWEEP_FLOOR: usize = 512;

    /// The shared copy of `value`: the one kept if some pod already holds an equal value, else `value`,
    /// kept from now on.
    pub fn intern(&mut self, value: Arc<T>) -> Arc<T> {
        if let Some(kept) = self.kept.get(&value) {
            return kept.clone();
        }
        self.kept.insert(value.clone());
        if self.kept.len() > 2 * self.swept.max(Self::SWEEP_FLOOR) {
            self.kept.retain(|v| Arc::strong_count(v) > 1);
            self.swept = self.kept.len();
        }
        value
    }

    /// Replaces `slot` with the shared copy of its value.
    pub fn share(&mut self, slot: &mut Arc<T>) {
        *slot = self.intern(slot.clone());
    }

    /// How many values are kept.
    pub fn len(&self) -> usize {
        self.kept.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.kept.is_empty()
    }

    /// Whether an equal value is kept.
    pub fn contains(&self, value: &T) -> bool {
        self.kept.contains(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_values_share_one_copy() {
        let mut pool = Pool::<str>::default();
        let a = pool.intern(Arc::from("node-1"));
        let b = pool.intern(Arc::from("node-1"));
        assert!(Arc::ptr_eq(&a, &b));
        let mut c: Arc<str> = Arc::from("node-1");
        pool.share(&mut c);
        assert!(Arc::ptr_eq(&a, &c));
        assert!(!Arc::ptr_eq(&a, &pool.intern(Arc::from("node-2"))));
    }

    #[test]
    fn values_nobody_holds_are_swept_and_those_in_use_never() {
        let mut pool = Pool::<str>::default();
        let held = pool.intern(Arc::from("held"));
        for i in 0..10_000 {
            drop(pool.intern(Arc::from(format!("gone-{i}").as_str())));
        }
        assert!(pool.len() <= 2 * Pool::<str>::SWEEP_FLOOR + 1, "{} kept", pool.len());
        assert!(pool.contains("held"));
        assert!(Arc::ptr_eq(&held, &pool.intern(Arc::from("held"))));
    }
}
