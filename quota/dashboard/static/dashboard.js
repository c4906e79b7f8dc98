// The overview updates itself: every 5 s it reads <base>/api/overview (same origin,
// the session cookie) and rewrites the health cells and the busiest keys, as text only.
(function () {
  "use strict";
  var base = document.body.getAttribute("data-base") || "";
  function text(id, value) {
    var el = document.getElementById(id);
    if (el) { el.textContent = value; }
  }
  function utc(epoch) {
    return new Date(epoch * 1000).toISOString().replace(/\.\d+Z$/, "Z").replace("T", " ");
  }
  function render(data) {
    var h = data.health;
    var state = !h.up ? "down: the memory fallback decides"
      : (h.reachable === false ? "unreachable" : "up");
    text("h-state", state);
    document.getElementById("h-state").className = (h.up && h.reachable !== false) ? "ok" : "bad";
    text("h-probe", h.latency !== null ? (h.latency * 1000).toFixed(1) + " ms" : (h.probe_error || "-"));
    var body = document.querySelector("#top tbody");
    if (!body) { return; }
    while (body.firstChild) { body.removeChild(body.firstChild); }
    data.top.forEach(function (u) {
      var tr = document.createElement("tr");
      var link = document.createElement("a");
      link.href = base + "/keys?key=" + encodeURIComponent(u.key);
      link.textContent = u.key;
      var cells = [link, String(u.window), String(u.count), utc(u.reset_at)];
      cells.forEach(function (c) {
        var td = document.createElement("td");
        if (typeof c === "string") { td.textContent = c; } else { td.appendChild(c); }
        tr.appendChild(td);
      });
      body.appendChild(tr);
    });
    text("updated", utc(data.time));
  }
  function poll() {
    fetch(base + "/api/overview", { credentials: "same-origin", headers: { "Accept": "application/json" } })
      .then(function (r) { if (!r.ok) { throw new Error(r.status); } return r.json(); })
      .then(render)
      .catch(function (e) { text("updated", "update failed (" + e.message + ")"); });
  }
  setInterval(poll, 5000);
})();
