"""Speed studies."""
