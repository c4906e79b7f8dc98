// The overview updates itself: every 5 s it reads <base>/api/overview (same origin,
// the session cookie) and rewrites the health cells, the decision rates and the busiest
// keys, as text only; the rates plot it replaces with the SVG the server renders
// (<base>/api/overview/rates.svg), parsed as XML and imported: no markup is ever
// assigned to innerHTML, and the CSP (script-src 'self') runs no script in it anyway.
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
  function perS(rate) { return rate === null ? "-" : rate.toFixed(2); }
  function label(value) { return value === "" ? "(none)" : value; }
  // Replaces the rows of `selector`'s body with one per item of `rows`, each cell as text.
  function fill(selector, rows, cells, empty, span) {
    var body = document.querySelector(selector);
    if (!body) { return; }
    while (body.firstChild) { body.removeChild(body.firstChild); }
    if (rows.length === 0) { rows = [null]; }
    rows.forEach(function (row) {
      var tr = document.createElement("tr");
      (row === null ? [empty] : cells(row)).forEach(function (c) {
        var td = document.createElement("td");
        td.textContent = c;
        if (row === null) { td.colSpan = span; }
        tr.appendChild(td);
      });
      body.appendChild(tr);
    });
  }
  function renderRates(r) {
    if (!r) { return; }
    fill("#rates-decisions tbody", r.decisions, function (row) {
      return [label(row.route), label(row.tier), perS(row.decisions_per_s),
        perS(row.denials_per_s), String(row.decisions), String(row.denials)];
    }, "no decision counted yet", 6);
    fill("#rates-shed tbody", r.shed, function (row) {
      return [label(row.route), perS(row.shed_per_s), String(row.shed)];
    }, "no request shed", 3);
    text("rates-interval", r.interval === null
      ? "the next update (the first poll has no interval)"
      : "the last " + r.interval.toFixed(1) + " s");
  }
  function redrawPlot() {
    var box = document.getElementById("rates-plot");
    if (!box) { return; }
    fetch(base + "/api/overview/rates.svg", { credentials: "same-origin" })
      .then(function (r) { if (!r.ok) { throw new Error(r.status); } return r.text(); })
      .then(function (svg) {
        var doc = new DOMParser().parseFromString(svg, "image/svg+xml");
        var root = doc.documentElement;
        if (root.namespaceURI !== "http://www.w3.org/2000/svg" || root.localName !== "svg"
            || doc.getElementsByTagName("parsererror").length) {
          throw new Error("not an SVG");
        }
        while (box.firstChild) { box.removeChild(box.firstChild); }
        box.appendChild(document.importNode(root, true));
      })
      .catch(function (e) { text("updated", "plot update failed (" + e.message + ")"); });
  }
  function render(data) {
    var h = data.health;
    var state = !h.up ? "down: the memory fallback decides"
      : (h.reachable === false ? "unreachable" : "up");
    text("h-state", state);
    document.getElementById("h-state").className = (h.up && h.reachable !== false) ? "ok" : "bad";
    text("h-probe", h.latency !== null ? (h.latency * 1000).toFixed(1) + " ms" : (h.probe_error || "-"));
    renderRates(data.rates);
    if (data.rates) { redrawPlot(); }
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
