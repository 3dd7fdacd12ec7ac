// Castor status pages: while a job runs, re-fetch this page every 2 s and swap its <main> in place.
// The pages are complete without this script; it only saves pressing reload.
(function () {
  "use strict";
  var content = document.getElementById("content");
  var status = document.getElementById("refresh-status");
  if (!content || content.dataset.live !== "true" || !window.fetch || !window.DOMParser) {
    return;
  }
  var period = parseInt(content.dataset.refreshMs, 10) || 2000;
  var busy = false;
  var timer = null;
  var lastUpdate = clock();

  function say(text, stale) {
    if (!status) return;
    status.textContent = text;
    status.classList.toggle("stale", !!stale);
  }

  function clock() {
    return new Date().toISOString().slice(11, 19) + " UTC";
  }

  function stop() {
    if (timer !== null) window.clearInterval(timer);
    timer = null;
  }

  function refresh() {
    if (busy || document.hidden) return;
    busy = true;
    fetch(window.location.href, { credentials: "same-origin", cache: "no-store", headers: { "X-Castor-Refresh": "1" } })
      .then(function (response) {
        if (response.redirected && new URL(response.url).pathname === "/login") {
          window.location.reload(); // signed out: show the login form
          return null;
        }
        if (!response.ok) throw new Error("HTTP " + response.status);
        return response.text();
      })
      .then(function (html) {
        if (html === null) return;
        var fresh = new DOMParser().parseFromString(html, "text/html").getElementById("content");
        if (!fresh) throw new Error("no content");
        var open = [];
        content.querySelectorAll("details[id][open]").forEach(function (d) { open.push(d.id); });
        content.innerHTML = fresh.innerHTML;
        open.forEach(function (id) {
          var d = document.getElementById(id);
          if (d) d.open = true;
        });
        if (fresh.dataset.live !== "true") {
          content.dataset.live = "false";
          say("updated " + clock() + " · no longer live");
          stop();
        } else {
          lastUpdate = clock();
          say("live · updated " + lastUpdate);
        }
      })
      .catch(function (error) {
        say("not updated since " + lastUpdate + " (" + error.message + ")", true);
      })
      .finally(function () {
        busy = false;
      });
  }

  say("live · refreshes every " + period / 1000 + " s");
  timer = window.setInterval(refresh, period);
  document.addEventListener("visibilitychange", function () {
    if (!document.hidden && timer !== null) refresh();
  });
})();
