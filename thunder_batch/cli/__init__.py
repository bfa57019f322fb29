"""`thunder-batch`: one module per command (generate, serve, compile, bench), the options they share
(`options`) and the dispatcher (`main`). Commands drive the libraries below them (engine, compile,
serve, bench); nothing below imports a command."""
