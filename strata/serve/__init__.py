"""The asyncio daemon behind `strata serve`: aiohttp app, OpenAI-compatible routes, engine thread, metrics, logging."""
