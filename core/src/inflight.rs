//! (owned by the filter engineer; see issue 3)
