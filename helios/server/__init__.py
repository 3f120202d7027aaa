"""HTTP server: transport, admission, auth, errors, health and metrics over the frontend."""
