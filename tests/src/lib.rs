//! braid-tests: workspace-level integration tests that cross crate boundaries (end-to-end flows land here).
