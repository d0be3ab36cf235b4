"""The web console: static pages (HTML, CSS, plain ES modules, SVG charts drawn by its own script) that the gateway
serves under /console. No build step and nothing fetched from elsewhere: the browser loads these files and talks
to the same JSON API every other client uses, with the bearer token the user logs in with."""
