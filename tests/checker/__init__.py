"""The checker's own tests (utils/checker/)."""
