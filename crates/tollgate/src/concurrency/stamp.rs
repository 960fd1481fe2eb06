//! An instant, compact.

use tokio::time::Instant;

/// An optional instant in 8 bytes (`Option<Instant>` takes 16): a permit
/// and an admission carry one each, and both are moved with every
/// response future and body, where each byte is copied again. Nanoseconds
/// from a process-wide origin, either side of it; `i64::MIN` for none.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stamp(i64);

impl Stamp {
    pub(crate) const NONE: Self = Self(i64::MIN);

    fn origin() -> Instant {
        static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        Instant::from_std(*ORIGIN.get_or_init(std::time::Instant::now))
    }

    /// `when`; none if it is too far to name (some 292 years from the
    /// origin: a cap that far is none).
    pub(crate) fn at(when: Instant) -> Self {
        let origin = Self::origin();
        let nanos = |d: std::time::Duration| i64::try_from(d.as_nanos()).ok();
        let ns = if when >= origin {
            nanos(when.duration_since(origin))
        } else {
            nanos(origin.duration_since(when)).map(i64::wrapping_neg)
        };
        match ns {
            Some(ns) if ns != i64::MIN => Self(ns),
            _ => Self::NONE,
        }
    }

    pub(crate) fn get(self) -> Option<Instant> {
        if self.0 == i64::MIN {
            return None;
        }
        let d = std::time::Duration::from_nanos(self.0.unsigned_abs());
        if self.0 >= 0 {
            Self::origin().checked_add(d)
        } else {
            Self::origin().checked_sub(d)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Stamp;
    use std::time::Duration;
    use tokio::time::Instant;

    #[test]
    fn a_stamp_keeps_its_instant_to_the_nanosecond() {
        let now = Instant::now();
        for when in [
            now,
            now + Duration::from_nanos(1),
            now + Duration::from_secs(86_400 * 365),
            now - Duration::from_millis(1),
        ] {
            assert_eq!(Stamp::at(when).get(), Some(when));
        }
        assert_eq!(Stamp::NONE.get(), None);
        // Too far to name: none, as a cap too far is.
        assert_eq!(
            Stamp::at(now + Duration::from_secs(400 * 365 * 86_400)).get(),
            None
        );
    }
}
