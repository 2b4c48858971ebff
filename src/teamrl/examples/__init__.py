"""Programs that teamrl trains as they are (``env.name: program``): users' multi-agent code, written with the official
``openai`` client, shipped so that the presets and docs/programs.md can run them."""
