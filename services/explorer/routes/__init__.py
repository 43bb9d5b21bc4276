"""HTTP routes: parse, call a service object, map the result."""
