"""The status pages show what the API and the flows recorded: jobs, placement, failures, plans,
checkpoints; escaped; 404s with the same look."""

from __future__ import annotations

import html
import re
import uuid

import httpx

from tests.integration.conftest import admin, create_job
from tests.integration.web.scenario import Scenario, eventually, running_job


def text_of(page: str) -> str:
    """The page's visible text, whitespace collapsed (good enough to assert on)."""
    without_tags = re.sub(r"<[^>]+>", " ", page)
    return " ".join(html.unescape(without_tags).split())


async def test_jobs_list_shows_the_counters_and_filters_by_state(signed_in: httpx.AsyncClient) -> None:
    job = await running_job(signed_in)
    await job.heartbeat(23)
    pending = await create_job(signed_in, machines=2)

    page = await signed_in.get("/")
    assert page.status_code == 200
    text = text_of(page.text)
    assert job.job["name"] in text and str(pending["name"]) in text
    row = text[text.index(str(job.job["name"])) :]
    assert re.match(
        rf"{job.job['name']} 4 machines · m=2 · group running 4 / 4 23 120.0 /min 0 0.00 s", row
    ), row[:200]
    assert f'href="/jobs/{job.id}"' in page.text
    assert 'data-live="true"' in page.text, "a running job keeps the list refreshing"

    running = text_of((await signed_in.get("/?state=running")).text)
    assert job.job["name"] in running and str(pending["name"]) not in running
    assert "running 1" in running and "pending 1" in running and "all 2" in running
    assert "No jobs in state completed" in text_of((await signed_in.get("/?state=completed")).text)
    unknown = await signed_in.get("/?state=<b>nope</b>&page=x")
    assert unknown.status_code == 200
    assert (
        "There is no job state &#39;&lt;b&gt;nope&lt;/b&gt;&#39;" in unknown.text
        and "<b>nope</b>" not in unknown.text
    )


async def test_jobs_list_pages(signed_in: httpx.AsyncClient) -> None:
    names = [(await create_job(signed_in, machines=1, replicas=1))["name"] for _ in range(27)]
    first = text_of((await signed_in.get("/")).text)
    assert "page 1 of 2" in first and names[-1] in first and names[0] not in first
    second = await signed_in.get("/?page=2")
    assert 'rel="prev"' in second.text and names[0] in text_of(second.text)
    assert names[-1] not in text_of(second.text)
    beyond = await signed_in.get("/?page=99999999999999999999999")
    assert beyond.status_code == 200 and 'rel="prev"' in beyond.text, "past the end: an empty page, no error"


async def test_job_page_shows_placement_machines_and_probabilities(signed_in: httpx.AsyncClient) -> None:
    job = await running_job(signed_in)
    await job.heartbeat(23)
    page = await signed_in.get(f"/jobs/{job.id}")
    assert page.status_code == 200
    text = text_of(page.text)
    assert f"{job.job['name']} running" in text
    assert "Group 0 2/2 healthy machine 0 healthy" in text and "Group 1 2/2 healthy machine 2 healthy" in text
    # Machine 1's box: its instance, newest local and replicated iteration, warm spares.
    box = text[text.index("machine 1 healthy") :]
    assert box.startswith("machine 1 healthy instance i-1 local 23 replicated 22 warm spares 1 heartbeat")
    assert "replicates to 0" in box
    placement = (await signed_in.get(f"/api/v1/jobs/{job.id}/placement", headers=admin())).json()
    probability = placement["recovery_probability"]
    assert probability["1"] == 1.0
    assert "k = 1 100.0 %" in text
    assert f"k = 2 {100 * probability['2']:.1f} %" in text
    assert "Machines healthy 4 / 4" in text and "Newest checkpoint 23" in text
    assert "No failures." in text
    assert 'data-live="true"' in page.text and '<script src="/static/castor.js' in page.text

    # The iteration chart: the root samples the running job's newest iteration every second.
    async def sampled() -> bool:
        return 'class="series"' in (await signed_in.get(f"/jobs/{job.id}")).text

    await eventually(sampled, "a sampled iteration", within=10)


async def test_a_failure_and_its_recovery_on_the_job_and_failure_pages(signed_in: httpx.AsyncClient) -> None:
    job = await running_job(signed_in)
    await job.heartbeat(23)
    failure_id = await job.kill_process(1)

    # While it recovers, the job page says so at the top.
    await job.plan(2, "collecting")
    recovering = text_of((await signed_in.get(f"/jobs/{job.id}")).text)
    assert "Recovering from failure #1 software" in recovering, "the job's first failure"
    assert "training process rank 1 was killed by SIGKILL" in recovering

    # Machine 1's own copy fails its checksum: rank 1 comes from its group peer's memory.
    await job.recover(22, corrupt_rank=1)
    event = (await signed_in.get(f"/api/v1/jobs/{job.id}/failures/{failure_id}", headers=admin())).json()
    assert event["state"] == "recovered" and event["tier"] == "peer" and event["iterations_lost"] == 1

    page = await signed_in.get(f"/jobs/{job.id}")
    text = text_of(page.text)
    assert event["number"] == 1
    assert "Last failure #1 software recovered Recovered from peer Iterations lost 1" in text
    timeline = text[text.index("Failures and recoveries") :]
    assert "#1 software recovered" in timeline
    assert re.search(r"peer 1 iteration lost resumed [\d.]+ s after detection", timeline), timeline
    for phase in ("detect", "classify", "restore", "resume"):
        assert re.search(rf"{phase} [\d.]+ s", timeline), phase
    assert "replace" not in timeline.split("Recovery plans")[0].replace("detect classify replace", ""), (
        "a software failure has no replace phase"
    )
    assert f'href="/jobs/{job.id}/failures/{failure_id}"' in page.text
    assert re.search(r'<rect class="phase-restore" x="[\d.]+" y="0" width="[\d.]+"', page.text), (
        "drawn as bars"
    )
    plans = text[text.index("Recovery plans") :]
    assert "2 ready 22 local x3, peer x1" in plans

    failure = await signed_in.get(f"/jobs/{job.id}/failures/{failure_id}")
    assert failure.status_code == 200
    text = text_of(failure.text)
    assert f"Failure #1 software recovered id {failure_id}" in text
    assert "Tier peer Iterations lost 1" in text and "Resumed from iteration 22 plan generation 2" in text
    assert "training process rank 1 was killed by SIGKILL" in text
    assert "Classification: software" in text and "Exit code -9" in text
    assert "machine of the failed process 1 i-1 healthy 127.0.0.1:7001" in text
    sources = text[text.index("Tier and source per rank") :]
    assert "0 local 0" in sources
    assert re.search(r"1 peer 0 127\.0\.0\.1:7000 \S+ 1 0\.25 s", sources), sources[:300]
    for phase in ("detect", "classify", "restore", "resume"):
        assert re.search(rf"{phase} \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC \d{{4}}", text), phase
    assert '"exit_code": -9' in html.unescape(failure.text), "the raw event details are there too"
    assert 'data-live="true"' in failure.text, "the job still runs"


async def test_user_controlled_text_is_escaped(signed_in: httpx.AsyncClient) -> None:
    # Instance ids hold no spaces or slashes (the registration refuses them): markup without them.
    attack = "<script>alert(1)<script>"
    scenario = Scenario(signed_in, await create_job(signed_in, machines=2, replicas=2))
    await scenario.register([f"i-{attack}", 'i-"><b>bold<b>'])
    await scenario.heartbeat(5)
    failure_id = await scenario.kill_process(0)
    await scenario.plan(2, "collecting")
    # A restore that failed with an error message that is HTML: the cause of an unknown failure.
    await scenario.post(
        "/machines/1/progress",
        {
            "instance_id": scenario.instances[1],
            "generation": 2,
            "event": "restore_failed",
            "details": {"error": "<img src=x onerror=alert(3)>"},
        },
        204,
    )
    failures = (await signed_in.get(f"/api/v1/jobs/{scenario.id}/failures", headers=admin())).json()
    unknown = next(f for f in failures if f["kind"] == "unknown")
    pages = [
        await signed_in.get(f"/jobs/{scenario.id}"),
        await signed_in.get(f"/jobs/{scenario.id}/failures/{failure_id}"),
        await signed_in.get(f"/jobs/{scenario.id}/failures/{unknown['id']}"),
    ]
    for page in pages:
        assert page.status_code == 200
        assert "<script>alert" not in page.text and "<img src=x" not in page.text
        assert "<b>bold" not in page.text
    assert "i-&lt;script&gt;alert(1)&lt;script&gt;" in pages[0].text
    assert "i-&lt;script&gt;alert(1)&lt;script&gt;" in pages[1].text
    assert "could not restore: &lt;img src=x onerror=alert(3)&gt;" in pages[2].text


async def test_unknown_ids_get_a_404_page_with_the_same_look(signed_in: httpx.AsyncClient) -> None:
    job = await running_job(signed_in, machines=2)
    other = await running_job(signed_in, machines=2, prefix="o")
    foreign = await other.kill_process(0)
    for path, message in [
        (f"/jobs/{uuid.uuid4()}", "There is no job"),
        ("/jobs/not-a-uuid", "There is no job 'not-a-uuid'"),
        (f"/jobs/{job.id}/failures/999999", "has no failure '999999'"),
        (f"/jobs/{job.id}/failures/99999999999999999999", "has no failure"),
        (f"/jobs/{job.id}/failures/\u00b2", "has no failure"),  # a digit to str.isdigit, not to int()
        (f"/jobs/{job.id}/failures/{foreign}", f"has no failure '{foreign}'"),
        ("/static/nope.css", "No static file"),
    ]:
        response = await signed_in.get(path)
        assert response.status_code == 404, path
        assert response.headers["content-type"].startswith("text/html")
        assert "<h1>Not found</h1>" in response.text and message in html.unescape(response.text), path
        assert '<link rel="stylesheet" href="/static/castor.css' in response.text
    # Without a session the 404 is not even reached: the login comes first.
    signed_in.cookies.clear()
    assert (await signed_in.get(f"/jobs/{uuid.uuid4()}")).status_code == 303


async def test_finished_jobs_stop_refreshing(signed_in: httpx.AsyncClient) -> None:
    job = await create_job(signed_in, machines=1, replicas=1)
    scenario = Scenario(signed_in, job)
    await scenario.register(["solo"])
    await scenario.post(
        "/machines/0/progress", {"instance_id": "solo", "generation": 1, "event": "finished"}, 204
    )
    assert (await scenario.api(""))["state"] == "completed"
    page = await signed_in.get(f"/jobs/{scenario.id}")
    assert 'data-live="false"' in page.text and "completed" in text_of(page.text)
    assert 'http-equiv="refresh"' not in page.text
