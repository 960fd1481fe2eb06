//! Calendar periods: where a minute, hour, day, ISO week, month or year
//! begins and ends, in UTC, at a fixed UTC offset, or (feature `tz`) in an
//! IANA time zone ([`Zone`]), exactly.
//!
//! A month is a calendar month — 28, 29, 30 or 31 days — not 30 days (Kong
//! counts a month as 30 days, and its users trip over it: Kong#2817,
//! #4076). Leap years follow the Gregorian rules. Weeks start on Monday
//! (ISO 8601). Arithmetic is on whole days and seconds (Howard Hinnant's
//! `days_from_civil`), so it is exact for every date a `u64` of Unix
//! nanoseconds can hold; the Redis store runs the same arithmetic in Lua.
//!
//! ```
//! use tollgate_core::calendar::{Offset, Period};
//!
//! // 2024-02-29T13:00:00Z, a leap day.
//! let t = 1_709_211_600 * 1_000_000_000;
//! let utc = Offset::UTC;
//! let (start, end) = Period::Month.bounds(t, utc);
//! assert_eq!(start / 1_000_000_000, 1_706_745_600); // 2024-02-01
//! assert_eq!((end - start) / 86_400_000_000_000, 29); // a 29-day February
//! // In Tokyo (+09:00) it is already 22:00 on the 29th: the same day.
//! let tokyo = Offset::from_hours_minutes(9, 0)?;
//! let (day, _) = Period::Day.bounds(t, tokyo);
//! assert_eq!(day / 1_000_000_000, 1_709_132_400); // 2024-02-29T00:00+09:00
//! # Ok::<(), tollgate_core::ConfigError>(())
//! ```

use std::fmt;

use crate::ConfigError;

const NANOS: u64 = 1_000_000_000;
const DAY: i64 = 86_400;

/// A calendar period a quota counts over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Period {
    /// A clock minute (`:00` to `:59`).
    Minute,
    /// A clock hour.
    Hour,
    /// A day, midnight to midnight.
    Day,
    /// An ISO week, Monday 00:00 to the next Monday.
    Week,
    /// A calendar month, the 1st to the 1st.
    Month,
    /// A calendar year, January 1st to January 1st.
    Year,
}

impl Period {
    /// Every period, shortest first.
    pub const ALL: [Period; 6] = [
        Period::Minute,
        Period::Hour,
        Period::Day,
        Period::Week,
        Period::Month,
        Period::Year,
    ];

    /// Its name: `minute`, `hour`, `day`, `week`, `month`, `year`.
    pub fn name(self) -> &'static str {
        match self {
            Period::Minute => "minute",
            Period::Hour => "hour",
            Period::Day => "day",
            Period::Week => "week",
            Period::Month => "month",
            Period::Year => "year",
        }
    }

    /// The period containing `unix_nanos` at `offset`: its start
    /// (inclusive) and end (exclusive), in Unix nanoseconds. Saturates at
    /// the ends of `u64` time rather than wrapping.
    pub fn bounds(self, unix_nanos: u64, offset: Offset) -> (u64, u64) {
        let secs = i64::try_from(unix_nanos / NANOS).unwrap_or(i64::MAX);
        let local = secs.saturating_add(i64::from(offset.0));
        let (start, end) = self.local_bounds(local);
        let back = |s: i64| -> u64 {
            let unix = s.saturating_sub(i64::from(offset.0)).max(0);
            u64::try_from(unix).unwrap_or(0).saturating_mul(NANOS)
        };
        (back(start), back(end))
    }

    /// The period containing `unix_nanos` in `zone`: its start (inclusive)
    /// and end (exclusive), in Unix nanoseconds. In an IANA zone a day runs
    /// from local midnight to local midnight, however long that is.
    pub fn bounds_in(self, unix_nanos: u64, zone: &Zone) -> (u64, u64) {
        if let Some(offset) = zone.fixed() {
            return self.bounds(unix_nanos, offset);
        }
        let secs = i64::try_from(unix_nanos / NANOS).unwrap_or(i64::MAX);
        let offset = zone.offset_at(secs);
        // A minute or an hour is the clock's at the instant's own offset:
        // in a fold (clocks going back) 01:xx happens twice, each an hour
        // of its own.
        if matches!(self, Period::Minute | Period::Hour) {
            let offset = Offset(i32::try_from(offset).unwrap_or(0));
            return self.bounds(unix_nanos, offset);
        }
        let local = secs.saturating_add(offset);
        let (start, end) = self.local_bounds(local);
        let back = |s: i64, end: bool| -> u64 {
            let unix = zone.unix_of_local(s, secs, end).max(0);
            u64::try_from(unix).unwrap_or(0).saturating_mul(NANOS)
        };
        let (start, end) = (back(start, false), back(end, true));
        // Whatever the zone's data says, the period holds the instant.
        (start.min(unix_nanos), end.max(unix_nanos.saturating_add(1)))
    }

    /// Bounds in local seconds (offset applied).
    fn local_bounds(self, local: i64) -> (i64, i64) {
        let floor_to = |unit: i64| {
            let start = local.div_euclid(unit).saturating_mul(unit);
            (start, start.saturating_add(unit))
        };
        let days = local.div_euclid(DAY);
        let at_day = |d: i64| d.saturating_mul(DAY);
        match self {
            Period::Minute => floor_to(60),
            Period::Hour => floor_to(3_600),
            Period::Day => floor_to(DAY),
            Period::Week => {
                // 1970-01-01 was a Thursday: Monday is 3 days before.
                let monday = days.saturating_sub(days.saturating_add(3).rem_euclid(7));
                (at_day(monday), at_day(monday.saturating_add(7)))
            }
            Period::Month => {
                let (y, m, _) = civil_from_days(days);
                let (ny, nm) = if m == 12 {
                    (y.saturating_add(1), 1)
                } else {
                    (y, m.saturating_add(1))
                };
                (
                    at_day(days_from_civil(y, m, 1)),
                    at_day(days_from_civil(ny, nm, 1)),
                )
            }
            Period::Year => {
                let (y, _, _) = civil_from_days(days);
                (
                    at_day(days_from_civil(y, 1, 1)),
                    at_day(days_from_civil(y.saturating_add(1), 1, 1)),
                )
            }
        }
    }
}

impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A fixed offset from UTC, in seconds east (e.g. +09:00 for Tokyo,
/// −05:00 for New York in winter). Fixed: it does not follow daylight
/// saving time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Offset(i32);

impl Offset {
    /// UTC.
    pub const UTC: Offset = Offset(0);

    /// `seconds` east of UTC, from −18:00 to +18:00 (ISO 8601's range).
    pub fn from_seconds(seconds: i32) -> Result<Self, ConfigError> {
        if !(-64_800..=64_800).contains(&seconds) {
            return Err(ConfigError::new("offset", "must be from -18:00 to +18:00"));
        }
        Ok(Self(seconds))
    }

    /// `hours` and `minutes` east of UTC; a negative `hours` is west
    /// (−5, 0 is −05:00; for −00:30 use [`from_seconds`](Self::from_seconds)).
    pub fn from_hours_minutes(hours: i32, minutes: u32) -> Result<Self, ConfigError> {
        if minutes >= 60 {
            return Err(ConfigError::new("offset", "minutes must be below 60"));
        }
        let minutes = i32::try_from(minutes).unwrap_or(0).saturating_mul(60);
        let seconds = hours.saturating_mul(3_600);
        Self::from_seconds(if hours < 0 {
            seconds.saturating_sub(minutes)
        } else {
            seconds.saturating_add(minutes)
        })
    }

    /// Seconds east of UTC.
    pub fn seconds(self) -> i32 {
        self.0
    }
}

/// Where a quota's periods begin: at a fixed offset from UTC, or (feature
/// `tz`) in an IANA time zone such as `Europe/Berlin`, whose days start at
/// local midnight on both sides of a daylight-saving change (a 23-hour day
/// in spring, a 25-hour day in autumn).
///
/// ```
/// use tollgate_core::calendar::{Offset, Zone};
///
/// let tokyo: Zone = Offset::from_hours_minutes(9, 0)?.into();
/// assert_eq!(tokyo.fixed(), Some(Offset::from_hours_minutes(9, 0)?));
/// assert_eq!(Zone::UTC.to_string(), "+00:00");
/// # Ok::<(), tollgate_core::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct Zone(ZoneKind);

#[derive(Clone)]
enum ZoneKind {
    Fixed(Offset),
    #[cfg(feature = "tz")]
    Iana(std::sync::Arc<str>, jiff::tz::TimeZone),
}

impl Zone {
    /// UTC.
    pub const UTC: Zone = Zone(ZoneKind::Fixed(Offset::UTC));

    /// The IANA time zone `name` (e.g. `America/New_York`), from the
    /// system's time zone database (`/usr/share/zoneinfo`), or the copy
    /// built in where the system has none. An unknown name is an error
    /// naming the field `time_zone`.
    #[cfg(feature = "tz")]
    pub fn iana(name: &str) -> Result<Self, ConfigError> {
        let tz = jiff::tz::TimeZone::get(name).map_err(|e| {
            ConfigError::new("time_zone", format!("unknown IANA time zone {name:?}: {e}"))
        })?;
        Ok(Self(ZoneKind::Iana(name.into(), tz)))
    }

    /// The fixed offset, if the zone is one.
    pub fn fixed(&self) -> Option<Offset> {
        match &self.0 {
            ZoneKind::Fixed(o) => Some(*o),
            #[cfg(feature = "tz")]
            ZoneKind::Iana(..) => None,
        }
    }

    /// The offset from UTC in force at Unix second `secs`.
    #[cfg_attr(not(feature = "tz"), allow(unused_variables))]
    fn offset_at(&self, secs: i64) -> i64 {
        match &self.0 {
            ZoneKind::Fixed(o) => i64::from(o.0),
            #[cfg(feature = "tz")]
            ZoneKind::Iana(_, tz) => jiff::Timestamp::from_second(secs)
                .map_or(0, |t| i64::from(tz.to_offset(t).seconds())),
        }
    }

    /// The Unix second at which the local time `local` (seconds since
    /// 1970-01-01T00:00 local) begins, as the start (`end` false) or the
    /// end of the period holding the instant `near`. A local time the
    /// clocks skipped (a gap) begins when they skipped it; one they went
    /// through twice (a fold) is, as a start, its latest occurrence not
    /// after `near`, and as an end, its first after `near`.
    #[cfg_attr(not(feature = "tz"), allow(unused_variables))]
    fn unix_of_local(&self, local: i64, near: i64, end: bool) -> i64 {
        match &self.0 {
            ZoneKind::Fixed(o) => local.saturating_sub(i64::from(o.0)),
            #[cfg(feature = "tz")]
            ZoneKind::Iana(_, tz) => {
                use jiff::tz::AmbiguousOffset;
                let fallback = local.saturating_sub(self.offset_at(near));
                let Some(dt) = civil(local) else {
                    return fallback;
                };
                let local_of = |o: jiff::tz::Offset| local.saturating_sub(i64::from(o.seconds()));
                match tz.to_ambiguous_timestamp(dt).offset() {
                    AmbiguousOffset::Unambiguous { offset } => local_of(offset),
                    // Skipped: the period begins at the transition, which
                    // the local time read at the offset before passes.
                    AmbiguousOffset::Gap { before, after } => {
                        let (a, b) = (local_of(before), local_of(after));
                        jiff::Timestamp::from_second(b.min(a))
                            .ok()
                            .and_then(|t| tz.following(t).next())
                            .map_or(a, |t| t.timestamp().as_second())
                            .clamp(b.min(a), a.max(b))
                    }
                    AmbiguousOffset::Fold { before, after } => {
                        let (first, second) = (local_of(before), local_of(after));
                        let (first, second) = (first.min(second), first.max(second));
                        match end {
                            false if second <= near => second,
                            false => first,
                            true if first > near => first,
                            true => second,
                        }
                    }
                }
            }
        }
    }
}

/// A civil date-time of `local` seconds since 1970-01-01T00:00 (`None`
/// past the years jiff holds).
#[cfg(feature = "tz")]
fn civil(local: i64) -> Option<jiff::civil::DateTime> {
    let (y, m, d) = civil_from_days(local.div_euclid(DAY));
    let t = local.rem_euclid(DAY); // [0, 86399]
    let narrow = |v: i64| i8::try_from(v).ok();
    jiff::civil::DateTime::new(
        i16::try_from(y).ok()?,
        i8::try_from(m).ok()?,
        i8::try_from(d).ok()?,
        narrow(t / 3_600)?,
        narrow(t / 60 % 60)?,
        narrow(t % 60)?,
        0,
    )
    .ok()
}

impl From<Offset> for Zone {
    fn from(offset: Offset) -> Self {
        Self(ZoneKind::Fixed(offset))
    }
}

impl Default for Zone {
    fn default() -> Self {
        Self::UTC
    }
}

impl PartialEq for Zone {
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            (ZoneKind::Fixed(a), ZoneKind::Fixed(b)) => a == b,
            #[cfg(feature = "tz")]
            (ZoneKind::Iana(a, _), ZoneKind::Iana(b, _)) => a == b,
            #[cfg(feature = "tz")]
            _ => false,
        }
    }
}

impl Eq for Zone {}

impl std::hash::Hash for Zone {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        match &self.0 {
            ZoneKind::Fixed(o) => o.hash(state),
            #[cfg(feature = "tz")]
            ZoneKind::Iana(name, _) => name.hash(state),
        }
    }
}

impl fmt::Display for Zone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            ZoneKind::Fixed(o) => {
                let sign = if o.0 < 0 { '-' } else { '+' };
                let abs = o.0.unsigned_abs();
                write!(f, "{sign}{:02}:{:02}", abs / 3_600, abs / 60 % 60)
            }
            #[cfg(feature = "tz")]
            ZoneKind::Iana(name, _) => f.write_str(name),
        }
    }
}

impl fmt::Debug for Zone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Zone({self})")
    }
}

/// Days since 1970-01-01 of the proleptic Gregorian date `y-m-d`
/// (Hinnant's `days_from_civil`; `m` 1 to 12, `d` 1 to 31).
// The unchecked operations work on values bounded as the comments say
// (or, for any `u32` month and day, far below `i64`'s range); the year's
// are saturating.
#[allow(clippy::arithmetic_side_effects)]
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y.saturating_sub(1) } else { y };
    let era = y.div_euclid(400);
    let yoe = y.saturating_sub(era.saturating_mul(400)); // [0, 399]
    let m = i64::from(m);
    let mp = if m > 2 { m - 3 } else { m + 9 }; // [0, 11]
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1; // [0, 365]
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy; // [0, 146096]
    era.saturating_mul(146_097)
        .saturating_add(doe)
        .saturating_sub(719_468)
}

/// The proleptic Gregorian date (year, month 1–12, day 1–31) of `days`
/// since 1970-01-01 (Hinnant's `civil_from_days`).
// Bounded as the comments say; the era's arithmetic saturates.
#[allow(clippy::arithmetic_side_effects)]
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days.saturating_add(719_468);
    let era = z.div_euclid(146_097);
    let doe = z.saturating_sub(era.saturating_mul(146_097)); // [0, 146096]
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365; // [0, 399]
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // [0, 365]
    let mp = (5 * doy + 2) / 153; // [0, 11]
    let d = doy - (153 * mp + 2) / 5 + 1; // [1, 31]
    let m = if mp < 10 { mp + 3 } else { mp - 9 }; // [1, 12]
    let y = yoe
        .saturating_add(era.saturating_mul(400))
        .saturating_add(i64::from(m <= 2));
    (
        y,
        u32::try_from(m).unwrap_or(1),
        u32::try_from(d).unwrap_or(1),
    )
}

/// Unix nanoseconds of `y-m-d h:mi:s` UTC (for tests and examples;
/// saturates outside `u64` time).
pub fn unix_nanos(y: i64, m: u32, d: u32, h: u32, mi: u32, s: u32) -> u64 {
    let secs = days_from_civil(y, m, d)
        .saturating_mul(DAY)
        .saturating_add(i64::from(h).saturating_mul(3_600))
        .saturating_add(i64::from(mi).saturating_mul(60))
        .saturating_add(i64::from(s));
    u64::try_from(secs.max(0))
        .unwrap_or(0)
        .saturating_mul(NANOS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(y: i64, m: u32, d: u32) -> u64 {
        unix_nanos(y, m, d, 0, 0, 0) / NANOS
    }

    fn bounds(p: Period, t: u64, o: Offset) -> (u64, u64) {
        let (a, b) = p.bounds(t, o);
        (a / NANOS, b / NANOS)
    }

    #[test]
    fn civil_round_trips_over_four_centuries() {
        let mut expect = (1970, 1, 1);
        for days in 0..146_097 * 2 {
            let got = civil_from_days(days);
            assert_eq!(got, expect, "day {days}");
            assert_eq!(days_from_civil(got.0, got.1, got.2), days);
            let (y, m, d) = expect;
            let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
            let len = match m {
                2 if leap => 29,
                2 => 28,
                4 | 6 | 9 | 11 => 30,
                _ => 31,
            };
            expect = if d < len {
                (y, m, d + 1)
            } else if m < 12 {
                (y, m + 1, 1)
            } else {
                (y + 1, 1, 1)
            };
        }
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }

    #[test]
    fn months_are_calendar_months() {
        let at = |y, m, d| unix_nanos(y, m, d, 12, 0, 0);
        for (y, m, len) in [
            (2023, 2, 28),
            (2024, 2, 29),
            (2100, 2, 28),
            (2000, 2, 29),
            (2026, 4, 30),
            (2026, 12, 31),
        ] {
            let (a, b) = bounds(Period::Month, at(y, m, 15), Offset::UTC);
            assert_eq!(a, secs(y, m, 1));
            assert_eq!((b - a) / 86_400, len, "{y}-{m}");
        }
        // The year's last second is in December; the next, in January.
        let eoy = unix_nanos(2026, 12, 31, 23, 59, 59);
        assert_eq!(bounds(Period::Month, eoy, Offset::UTC).1, secs(2027, 1, 1));
        assert_eq!(
            bounds(Period::Year, eoy + NANOS, Offset::UTC),
            (secs(2027, 1, 1), secs(2028, 1, 1))
        );
        assert_eq!(
            bounds(Period::Year, at(2024, 7, 1), Offset::UTC),
            (secs(2024, 1, 1), secs(2025, 1, 1))
        );
    }

    #[test]
    fn weeks_start_on_monday_and_offsets_move_midnight() {
        // 2026-12-02 is a Wednesday.
        let wed = unix_nanos(2026, 12, 2, 10, 0, 0);
        assert_eq!(
            bounds(Period::Week, wed, Offset::UTC),
            (secs(2026, 11, 30), secs(2026, 12, 7))
        );
        // Sunday 23:30 UTC is still last week in UTC, Monday in Tokyo.
        let sun = unix_nanos(2026, 12, 6, 23, 30, 0);
        let tokyo = Offset::from_hours_minutes(9, 0).unwrap();
        assert_eq!(bounds(Period::Week, sun, Offset::UTC).0, secs(2026, 11, 30));
        assert_eq!(
            bounds(Period::Week, sun, tokyo).0,
            secs(2026, 12, 7) - 9 * 3_600
        );
        // New York in winter: the day starts at 05:00 UTC.
        let ny = Offset::from_hours_minutes(-5, 0).unwrap();
        let early = unix_nanos(2026, 12, 2, 4, 0, 0);
        assert_eq!(
            bounds(Period::Day, early, ny),
            (secs(2026, 12, 1) + 5 * 3_600, secs(2026, 12, 2) + 5 * 3_600)
        );
        assert_eq!(
            bounds(Period::Hour, early + 59 * 60 * NANOS, Offset::UTC),
            (early / NANOS, early / NANOS + 3_600)
        );
        assert_eq!(
            bounds(Period::Minute, early + 61 * NANOS, Offset::UTC),
            (early / NANOS + 60, early / NANOS + 120)
        );
        assert_eq!(
            Offset::from_hours_minutes(-5, 30).unwrap().seconds(),
            -19_800
        );
        assert_eq!(Offset::from_seconds(70_000).unwrap_err().field(), "offset");
        assert_eq!(
            Offset::from_hours_minutes(1, 60).unwrap_err().field(),
            "offset"
        );
    }

    #[test]
    fn the_ends_of_time_do_not_panic() {
        for p in Period::ALL {
            for t in [0, 1, u64::MAX, u64::MAX / 2] {
                for o in [
                    Offset::UTC,
                    Offset::from_seconds(64_800).unwrap(),
                    Offset::from_seconds(-64_800).unwrap(),
                ] {
                    let (a, b) = p.bounds(t, o);
                    assert!(a <= b);
                }
            }
        }
    }

    /// IANA zones: a day runs from local midnight to local midnight on
    /// the two transition days (23 and 25 hours), in Berlin and New York;
    /// where midnight itself is skipped (Havana, spring) the day begins at
    /// the transition, and where it happens twice (Havana, autumn) at the
    /// first.
    #[cfg(feature = "tz")]
    #[test]
    fn iana_days_run_from_local_midnight_across_daylight_saving() {
        let hours = |(a, b): (u64, u64)| (b - a) / 3_600 / NANOS;
        let day = |zone: &str, t: u64| {
            let (a, b) = Period::Day.bounds_in(t, &Zone::iana(zone).unwrap());
            assert!(a <= t && t < b, "{zone}: {t} outside its day");
            (a, b)
        };
        let at = |y, m, d, h, mi| unix_nanos(y, m, d, h, mi, 0);
        // Berlin: 2026-03-29 from 00:00 CET (23:00Z) to 00:00 CEST (22:00Z).
        let spring = day("Europe/Berlin", at(2026, 3, 29, 12, 0));
        assert_eq!(spring, (at(2026, 3, 28, 23, 0), at(2026, 3, 29, 22, 0)));
        assert_eq!(hours(spring), 23);
        let autumn = day("Europe/Berlin", at(2026, 10, 25, 12, 0));
        assert_eq!(autumn, (at(2026, 10, 24, 22, 0), at(2026, 10, 25, 23, 0)));
        assert_eq!(hours(autumn), 25);
        // The instants around each end belong to the right day.
        assert_eq!(day("Europe/Berlin", at(2026, 3, 29, 21, 59)).1, spring.1);
        assert_eq!(day("Europe/Berlin", at(2026, 3, 29, 22, 0)).0, spring.1);
        assert_eq!(day("Europe/Berlin", at(2026, 10, 25, 22, 59)).1, autumn.1);
        // New York, whose clocks change at 02:00.
        let ny = day("America/New_York", at(2026, 3, 8, 12, 0));
        assert_eq!(ny, (at(2026, 3, 8, 5, 0), at(2026, 3, 9, 4, 0)));
        let ny = day("America/New_York", at(2026, 11, 1, 12, 0));
        assert_eq!(ny, (at(2026, 11, 1, 4, 0), at(2026, 11, 2, 5, 0)));
        // Havana skips midnight on 2026-03-08 (00:00 CST is 01:00 CDT, at
        // 05:00Z) and goes through it twice on 2026-11-01 (04:00Z, 05:00Z).
        let gap = day("America/Havana", at(2026, 3, 8, 12, 0));
        assert_eq!(gap, (at(2026, 3, 8, 5, 0), at(2026, 3, 9, 4, 0)));
        assert_eq!(day("America/Havana", at(2026, 3, 8, 4, 59)).1, gap.0);
        // Its first midnight starts the day for the hour between them; a
        // window taken then lasts the 25 hours, one taken later 24.
        let early = day("America/Havana", at(2026, 11, 1, 4, 30));
        assert_eq!(early, (at(2026, 11, 1, 4, 0), at(2026, 11, 2, 5, 0)));
        let fold = day("America/Havana", at(2026, 11, 1, 12, 0));
        assert_eq!(fold, (at(2026, 11, 1, 5, 0), at(2026, 11, 2, 5, 0)));
        // Minutes and hours in New York's fold (01:xx twice, 05:xxZ and
        // 06:xxZ): each occurrence is a period of its own.
        let ny = Zone::iana("America/New_York").unwrap();
        let hour = |t| Period::Hour.bounds_in(t, &ny);
        assert_eq!(
            hour(at(2026, 11, 1, 5, 30)),
            (at(2026, 11, 1, 5, 0), at(2026, 11, 1, 6, 0))
        );
        assert_eq!(
            hour(at(2026, 11, 1, 6, 30)),
            (at(2026, 11, 1, 6, 0), at(2026, 11, 1, 7, 0))
        );
        let minute = Period::Minute.bounds_in(at(2026, 11, 1, 6, 30), &ny);
        assert_eq!(minute, (at(2026, 11, 1, 6, 30), at(2026, 11, 1, 6, 31)));
        // A month and a year in a zone: local midnights at either end.
        let month = Period::Month.bounds_in(
            at(2026, 11, 15, 0, 0),
            &Zone::iana("America/New_York").unwrap(),
        );
        assert_eq!(month, (at(2026, 11, 1, 4, 0), at(2026, 12, 1, 5, 0)));
        let year =
            Period::Year.bounds_in(at(2026, 7, 1, 0, 0), &Zone::iana("Europe/Berlin").unwrap());
        assert_eq!(year, (at(2025, 12, 31, 23, 0), at(2026, 12, 31, 23, 0)));
        // A fixed zone is its offset.
        let tokyo: Zone = Offset::from_hours_minutes(9, 0).unwrap().into();
        let t = at(2026, 3, 29, 12, 0);
        assert_eq!(
            Period::Day.bounds_in(t, &tokyo),
            Period::Day.bounds(t, Offset(9 * 3_600))
        );
        assert_eq!(Zone::iana("Mars/Olympus").unwrap_err().field(), "time_zone");
        assert_eq!(
            Zone::iana("Europe/Berlin").unwrap().to_string(),
            "Europe/Berlin"
        );
        assert_eq!(tokyo.to_string(), "+09:00");
        assert_eq!(
            Zone::from(Offset(-(5 * 3_600 + 1_800))).to_string(),
            "-05:30"
        );
    }
}
