"""The HTTP front end: routes, the guard (API key, Host, CORS), SSE transport, the dashboard.
Request bodies are parsed and results shaped in minisgl.protocol; requests run on the
runtime."""
